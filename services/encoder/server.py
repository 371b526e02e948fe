"""The Mimi encoder stage: one Encode stream per session, frames of all streams batched.

Per frame: 1920 float32 samples (7680 bytes, finite) -> 8 codes in [0, 2048).
"""

from __future__ import annotations

import numpy as np
import torch

from duplex.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc
from services.codec.stage import CodecService, CodecServicer, inference_step, load_mimi
from services.common.errors import InvalidArgument
from services.encoder.config import EncoderConfig

SERVICE_NAME = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name


def parse_pcm(frame: common_pb2.PcmFrame, frame_size: int) -> torch.Tensor:
    """PcmFrame -> Tensor[frame_size] f32; INVALID_ARGUMENT on a wrong length or a non-finite sample."""
    data = frame.pcm_f32le
    if len(data) != 4 * frame_size:
        raise InvalidArgument(
            f"frame seq {frame.seq}: pcm_f32le has {len(data)} bytes, expected {4 * frame_size} ({frame_size} float32 "
            "samples)",
            kind="bad_frame",
        )
    pcm = np.frombuffer(data, dtype="<f4")
    if not np.isfinite(pcm).all():
        raise InvalidArgument(f"frame seq {frame.seq}: pcm has NaN or infinite samples", kind="bad_frame")
    return torch.from_numpy(pcm.astype(np.float32))


class EncoderServicer(CodecServicer, encoder_pb2_grpc.EncoderServicer):
    async def Encode(self, request_iterator, context):
        await self.stream.serve(context)

    async def EncodeLink(self, request_iterator, context):
        await self.serve_link(context, encoder_pb2.EncodeLinkResponse)


def build(cfg: EncoderConfig) -> CodecService:
    from services.codec.mimi import StreamingEncoder

    model, mimi_cfg = load_mimi(cfg, keep="encode")  # the decode half is never loaded onto the device
    encoder = StreamingEncoder(model, cfg.slots, cuda_graph=cfg.cuda_graph)
    frame_size = mimi_cfg.frame_size
    return CodecService(
        "encoder", cfg,
        step=inference_step(encoder.step, cfg.device),
        reset=encoder.reset,
        in_shape=(frame_size,),
        in_dtype=torch.float32,
        parse_frame=lambda frame: parse_pcm(frame, frame_size),
        opened=lambda slot: encoder_pb2.EncodeResponse(opened=encoder_pb2.EncodeResponse.Opened(slot=slot)),
        answer=lambda seq, codes: encoder_pb2.EncodeResponse(
            codes=common_pb2.CodesFrame(seq=seq, codes=codes.tolist())),

        servicer_cls=EncoderServicer,
        add_servicer=encoder_pb2_grpc.add_EncoderServicer_to_server,
        service_name=SERVICE_NAME,
        codec=encoder,
    )
