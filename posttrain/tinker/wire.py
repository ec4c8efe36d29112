"""The Tinker wire formats the service reads and writes: forward_backward requests and their outputs, and
sample responses, as the SDK's protobuf messages; datums from the JSON form too."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from posttrain.tinker.model import Datum, UserError


def public_pb() -> Any:
    """The SDK's protobuf module (imported when the service starts)."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as error:
        raise ImportError("serve-tinker needs the Tinker SDK: pip install 'posttrain[tinker]'") from error
    return tinker_public_pb2


def tensor_from_proto(msg: Any) -> torch.Tensor:
    """A dense public Tensor message as a flat torch tensor (float32 or int64)."""
    pb = public_pb()
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes or msg.HasField("sparse_csr"):
        raise UserError("loss_fn_inputs must be dense float32 or int64 tensors")
    array = np.frombuffer(msg.dense, dtype=dtypes[msg.dtype]).copy()
    return torch.from_numpy(array.astype(np.int64) if msg.dtype == pb.DTYPE_INT32 else array)


def parse_forward_backward(body: bytes) -> tuple[Any, list[Datum]]:
    """The request message and its datums (text chunks only) from a protobuf forward_backward body."""
    msg = public_pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as error:  # protobuf's DecodeError
        raise ValueError(f"the body is not a ForwardBackwardRequest: {error}") from None
    data = []
    for datum in msg.data:
        tokens: list[int] = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise UserError(f"only text chunks are served, got {chunk.WhichOneof('chunk')}")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {name: tensor_from_proto(tensor) for name, tensor in datum.loss_fn_inputs.items()}
        data.append(Datum(tokens, inputs))
    return msg, data


def forward_backward_output(outputs: list[dict[str, torch.Tensor]], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput message: one ArrayRecord with each field's per-datum float32 arrays."""
    pb = public_pb()
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else []:
        arrays = [output[name].numpy().astype(np.float32) for output in outputs]
        offsets = np.cumsum([0] + [array.nbytes for array in arrays]).astype(np.int64)
        record.fields[name].CopyFrom(
            pb.BatchedTensor(
                data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32
            )
        )
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    out.loss_fn_outputs.append(record)
    return out.SerializeToString()


def sample_response(sequences: list[dict[str, Any]], prompt_logprobs: list[float] | None) -> bytes:
    """A SampleResponse message; each sequence has token_ids, logprobs and truncated (stop reason length)."""
    pb = public_pb()
    out = pb.SampleResponse()
    for sequence in sequences:
        out.sequences.add(
            tokens=np.asarray(sequence["token_ids"], dtype=np.int32).tobytes(),
            logprobs=np.asarray(sequence["logprobs"], dtype=np.float32).tobytes(),
            stop_reason=pb.STOP_REASON_LENGTH if sequence["truncated"] else pb.STOP_REASON_STOP,
        )
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return out.SerializeToString()


def prompt_tokens(model_input: Any) -> list[int]:
    """The token ids of a JSON ModelInput ({"chunks": [{"type": "encoded_text", "tokens": [...]}]})."""
    tokens: list[int] = []
    for chunk in (model_input or {}).get("chunks", []):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"only text chunks are served, got {chunk.get('type')}")
        tokens.extend(int(token) for token in chunk["tokens"])
    return tokens
