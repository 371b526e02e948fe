"""The Mimi decoder stage: one Decode stream per session, frames of all streams batched.

Per frame: 8 codes, each in [0, bins) -> 1920 float32 samples (7680 bytes, little-endian).
"""

from __future__ import annotations

import torch

from duplex.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc
from services.codec.stage import CodecService, CodecServicer, inference_step, load_mimi
from services.common.errors import InvalidArgument
from services.decoder.config import DecoderConfig

SERVICE_NAME = decoder_pb2.DESCRIPTOR.services_by_name["Decoder"].full_name


def parse_codes(frame: common_pb2.CodesFrame, num_codebooks: int, bins: int) -> torch.Tensor:
    """CodesFrame -> LongTensor[num_codebooks]; INVALID_ARGUMENT on a wrong count or a code out of range."""
    codes = list(frame.codes)
    if len(codes) != num_codebooks:
        raise InvalidArgument(f"frame seq {frame.seq}: {len(codes)} codes, expected {num_codebooks}", kind="bad_frame")
    bad = [c for c in codes if c >= bins]  # uint32: never negative
    if bad:
        raise InvalidArgument(f"frame seq {frame.seq}: code {bad[0]} is outside [0, {bins})", kind="bad_frame")
    return torch.tensor(codes, dtype=torch.long)


def pcm_answer(seq: int, pcm: torch.Tensor) -> decoder_pb2.DecodeResponse:
    data = pcm.to(torch.float32).numpy().astype("<f4").tobytes()
    return decoder_pb2.DecodeResponse(pcm=common_pb2.PcmFrame(seq=seq, pcm_f32le=data))


class DecoderServicer(CodecServicer, decoder_pb2_grpc.DecoderServicer):
    async def Decode(self, request_iterator, context):
        await self.stream.serve(context)

    async def DecodeLink(self, request_iterator, context):
        await self.serve_link(context, decoder_pb2.DecodeLinkResponse)


def build(cfg: DecoderConfig) -> CodecService:
    from services.codec.mimi import StreamingDecoder

    model, mimi_cfg = load_mimi(cfg, keep="decode")  # the encode half is never loaded onto the device
    decoder = StreamingDecoder(model, cfg.slots, cuda_graph=cfg.cuda_graph)
    n, bins = mimi_cfg.num_codebooks, mimi_cfg.bins
    return CodecService(
        "decoder", cfg,
        step=inference_step(decoder.step, cfg.device),
        reset=decoder.reset,
        in_shape=(n,),
        in_dtype=torch.long,
        parse_frame=lambda frame: parse_codes(frame, n, bins),
        opened=lambda slot: decoder_pb2.DecodeResponse(opened=decoder_pb2.DecodeResponse.Opened(slot=slot)),
        answer=pcm_answer,
        servicer_cls=DecoderServicer,
        add_servicer=decoder_pb2_grpc.add_DecoderServicer_to_server,
        service_name=SERVICE_NAME,
        codec=decoder,
    )
