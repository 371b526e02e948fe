import os

# gRPC's fork handlers, on by default, run in a child forked while another thread is inside gRPC
# and can abort it before it execs (subprocess with preexec_fn forks; 2 of 30 children died in a
# test beside a busy channel). Every process here execs right after forking and never uses gRPC
# across a fork, so the handlers are off. Read when grpc is first imported: set before that.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
