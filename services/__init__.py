import os

# gRPC's fork handlers, on by default, run in a child forked while another thread is inside gRPC
# and can abort it before it execs (subprocess with preexec_fn forks; 2 of 30 children died in a
# test beside a busy channel). Every process here execs right after forking and never uses gRPC
# across a fork, so the handlers are off. Read when grpc is first imported: set before that.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

# oneDNN's AMX kernels (CPUs with amx_bf16) give wrong bfloat16 results in torch 2.13 on the CPU: a bf16
# Mimi's codes agreed with fp32's on 1.6 % instead of over 75 % (tests/test_mimi.py), and capping the
# ISA one step below AMX restores them. Read when oneDNN first runs: set before torch computes anything.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
