"""A pooling request's embedding from the model's final hidden states."""
from __future__ import annotations

import torch

from tierlm.sampling_params import PoolingParams


@torch.inference_mode()
def pooled_embedding(last_hidden: torch.Tensor, params: PoolingParams) -> list[float]:
    """Last-token pooling: the final-normed hidden state of the prompt's last token, in float32,
    its first `dimensions` entries when asked (Matryoshka), L2-normalised when asked (a zero
    vector stays zero)."""
    vec = last_hidden.float()
    if params.dimensions is not None:
        vec = vec[..., :params.dimensions]
    if params.normalize:
        vec = torch.nn.functional.normalize(vec, dim=-1)
    return vec.cpu().tolist()
