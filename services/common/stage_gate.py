"""What a stage checks on every RPC before its handler runs (a grpc.aio server interceptor).

- The link token. With DUPLEX_LINK_TOKEN set in a stage's environment, every session RPC (Talk,
  Encode, Decode and their Links: whatever takes a slot or holds memory) needs the metadata
  `authorization: Bearer <token>`, which the gateway presents on its links (the same variable in
  its environment: `link_metadata()`). Without it the call ends UNAUTHENTICATED (kind
  bad_link_token) before its handler runs, so a local client cannot bypass the gateway's API
  key. Health, reflection, GetCapacity and ListVoices stay open (read only); Drain has its own
  admin token. Unset: no check (`make run` and the tests' raw clients work as they are).
- Link messages: every Link method's requests are counted on their bytes before they are parsed
  (link.checked_parser), so a message of a million tiny entries is refused, not parsed.
"""

from __future__ import annotations

import hmac
import os

import grpc

from services.common.errors import StageError, Unauthenticated
from services.common.link import checked_parser

LINK_TOKEN_ENV = "DUPLEX_LINK_TOKEN"
# What any caller may use (the token guards the rest): probes, tooling, read-only state, and Drain
# (which needs the admin token).
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/")
OPEN_RPCS = ("/GetCapacity", "/Drain", "/ListVoices")


def link_metadata(token: str | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata a caller of a stage's session RPCs presents: the bearer link token, from
    DUPLEX_LINK_TOKEN unless given; none when there is no token."""
    token = token if token is not None else os.environ.get(LINK_TOKEN_ENV, "")
    return (("authorization", f"Bearer {token}"),) if token else ()


def is_open(method: str) -> bool:
    return method.startswith(OPEN_SERVICES) or method.endswith(OPEN_RPCS)


def has_token(metadata, token: str) -> bool:
    """Whether the call's metadata holds `authorization: Bearer <token>` (compared in constant time)."""
    sent = dict(metadata or ()).get("authorization", "")
    scheme, _, value = sent.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


class StageGate(grpc.aio.ServerInterceptor):
    def __init__(self, runtime):
        self.runtime = runtime  # its link_token (None: no check), metrics and log

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None  # an unknown method: gRPC answers UNIMPLEMENTED
        token = self.runtime.link_token
        if token and not is_open(details.method) and not has_token(details.invocation_metadata, token):
            return _refusal(handler, Unauthenticated(
                f"{self.runtime.stage}: {details.method.rsplit('/', 1)[-1]} needs 'authorization: Bearer "
                f"<{LINK_TOKEN_ENV}>' (the gateway presents it)", kind="bad_link_token"), self.runtime)
        if details.method.endswith("Link") and handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                handler.stream_stream, request_deserializer=checked_parser(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        return handler


def _refusal(handler: grpc.RpcMethodHandler, error: StageError, runtime) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with `error`, reading nothing."""

    async def refuse(request, context):
        await runtime.fail(context, error)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
