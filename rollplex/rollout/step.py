"""One decode step of the language model, written against static buffers so that a CUDA graph can replay it.

`DecodeStep.forward(rows, prompts)` feeds each of the first `rows` batch rows its slot's last sampled token, runs the
decoder with the fused kernels (`rollplex.kernels.decode_ops`) and the cascade attention over the shared
prompt KV and the response cache (`rollplex.kernels.decode_attention`), advances the step counter, leaves
the logits in `self.logits[:rows]` and, with fused sampling, samples the next token into `tokens`,
`logprobs`, `last_token` and `done` (`rollplex.kernels.sampling`). It reads the actor's parameters in place
(no copy) and allocates only the step's activations. Everything that changes between steps lives in device
tensors: `slots`, `row_start`, `row_count`, `batch_prompts`, `step`, `last_token`; the batch's rows and how many
prompts they span are fixed per call (per captured graph). Not here: retiring sequences and top-p
sampling (`engine.py`), capture (`graphs.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rollplex.kernels.decode_attention import DecodeAttention, DecodeAttentionShape
from rollplex.kernels.decode_ops import add_rms_norm, rotary_to_cache
from rollplex.kernels.sampling import MAX_STOP_IDS, fused_sample
from rollplex.models.boundary import Boundary
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.rotary import text_rotary
from rollplex.models.sampling import SamplingParams
from rollplex.parallel.group import all_gather_into
from rollplex.rollout.weights import CUBLAS, DecodeKernels, layer_weights


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """The capacities one set of buffers (and captured graphs) serves; a rollout that fits reuses them."""

    num_prompts: int
    num_samples: int
    max_prompt_len: int  # S: prompt KV capacity per prompt
    max_tokens: int  # R: response tokens per sequence
    max_position: int  # rotary table length: > every prompt's next position + R
    fused_sampling: bool  # the step samples in-graph (`rollplex.kernels.sampling`); else the caller samples

    @property
    def num_slots(self) -> int:
        """Sequences, plus the spare slot that padding rows write to."""
        return self.num_prompts * self.num_samples + 1

    def fits(self, boundary: Boundary, num_samples: int, params: SamplingParams) -> bool:
        return (
            (boundary.num_prompts, num_samples) == (self.num_prompts, self.num_samples)
            and (params.max_tokens, can_fuse_sampling(params)) == (self.max_tokens, self.fused_sampling)
            and boundary.max_prompt_len <= self.max_prompt_len
            and int(boundary.next_positions.max()) + params.max_tokens <= self.max_position
        )


def _kv_shapes(model: Qwen2_5_VL, shape: DecodeShape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per layer: the response cache [slots, groups, R, D] and the prompt KV [P, groups, S, D]."""
    groups, d = layer_weights(model.model.language_model.layers[0]).num_groups, model.config.text.head_dim
    return (shape.num_slots, groups, shape.max_tokens, d), (shape.num_prompts, groups, shape.max_prompt_len, d)


def kv_bytes(model: Qwen2_5_VL, shape: DecodeShape) -> int:
    """Bytes of every layer's K and V caches, response and prompt, for one decode shape."""
    cache, prompt = _kv_shapes(model, shape)
    itemsize = model.lm_head.weight.dtype.itemsize
    return 2 * model.config.text.num_hidden_layers * (math.prod(cache) + math.prod(prompt)) * itemsize


def check_rows(rows: tuple[Sequence[int], int], num_sequences: int) -> None:
    """ValueError unless rows (index, total) names num_sequences distinct rows of a batch of `total`."""
    index, total = rows
    if len(index) != num_sequences or len(set(index)) != len(index) or not all(0 <= i < total for i in index):
        raise ValueError(f"rows {list(index)[:8]}... of {total}: not {num_sequences} distinct rows of the batch")


def can_fuse_sampling(params: SamplingParams) -> bool:
    """The fused sampler does temperature (and greedy) but not top-p, and at most MAX_STOP_IDS stop tokens."""
    return params.top_p == 1.0 and len(params.stop_token_ids) <= MAX_STOP_IDS


class DecodeStep:
    """Static decode state of one `DecodeShape` for one model: caches, prompt KV, rotary tables, row maps."""

    def __init__(
        self,
        model: Qwen2_5_VL,
        shape: DecodeShape,
        kv: Tensor | None = None,
        kernels: DecodeKernels = CUBLAS,
    ) -> None:
        """kv: optional uint8 storage of at least `kv_bytes(model, shape)` for the caches (a VMM region the
        engine releases between rollouts); by default they are allocated here. kernels: which kernels the step
        runs (`weights.DecodeKernels`)."""
        text, device, dtype = model.config.text, model.device, model.lm_head.weight.dtype
        self.model, self.shape = model, shape
        self.weights = [layer_weights(layer, kernels) for layer in model.model.language_model.layers]  # in place
        self.group = self.weights[0].group  # the rollout replica's TP group (size 1 for a full model)
        heads, d = self.weights[0].num_heads, text.head_dim
        cache, prompt = _kv_shapes(model, shape)
        kv = kv if kv is not None else torch.zeros(kv_bytes(model, shape), dtype=torch.uint8, device=device)
        assert kv.dtype == torch.uint8 and kv.numel() >= kv_bytes(model, shape), "kv storage too small"
        tensors, offset = [], 0
        for size in [cache] * 2 * text.num_hidden_layers + [prompt] * 2 * text.num_hidden_layers:
            num_bytes = math.prod(size) * dtype.itemsize
            tensors.append(kv[offset : offset + num_bytes].view(dtype).view(size))
            offset += num_bytes
        num_layers = text.num_hidden_layers
        self.k_cache, self.v_cache = tensors[:num_layers], tensors[num_layers : 2 * num_layers]
        self.prompt_k, self.prompt_v = tensors[2 * num_layers : 3 * num_layers], tensors[3 * num_layers :]
        positions = torch.arange(shape.max_position, device=device).expand(3, 1, -1)
        cos, sin = text_rotary(positions, text)  # [1, 1, positions, D]
        self.cos, self.sin = cos[0, 0].contiguous(), sin[0, 0].contiguous()
        long = dict(dtype=torch.long, device=device)
        self.prompt_lens = torch.zeros(shape.num_prompts, **long)
        self.next_positions = torch.zeros(shape.num_prompts + 1, **long)  # the spare prompt of padding rows: 0
        self.row_start = torch.zeros(shape.num_prompts, **long)
        self.row_count = torch.zeros(shape.num_prompts, **long)
        self.batch_prompts = torch.arange(shape.num_prompts, **long)  # those with rows in the batch first
        self.slots = torch.arange(shape.num_slots - 1, **long)
        self.step = torch.zeros(1, **long)
        self.last_token = torch.zeros(shape.num_slots, **long)
        self.tokens = torch.zeros(shape.num_slots, shape.max_tokens, **long)  # [slot, column]
        self.logprobs = torch.zeros(shape.num_slots, shape.max_tokens, dtype=torch.float32, device=device)
        self.done = torch.zeros(shape.num_slots, dtype=torch.int8, device=device)
        self.max_lens = torch.full((shape.num_slots,), shape.max_tokens, **long)  # per-sequence length budgets
        self.seed = torch.zeros(1, **long)
        self.batch_rows = torch.arange(shape.num_slots, **long)  # each slot's row in the step's whole batch
        self.batch_slots = torch.full((1,), shape.num_slots, **long)  # the whole batch's slots
        self.temperature = torch.zeros(1, dtype=torch.float32, device=device)
        self.stop_ids = torch.full((MAX_STOP_IDS,), -1, **long)
        self.logits = torch.empty(shape.num_slots - 1, text.vocab_size, dtype=dtype, device=device)
        self.logit_parts = torch.empty_like(self.logits).flatten() if self.group.size > 1 else None
        self.attention = DecodeAttention(
            DecodeAttentionShape(
                shape.num_prompts, shape.num_samples, heads, self.weights[0].num_groups, d,
                shape.max_prompt_len, shape.max_tokens,
            ),
            device,
        )  # fmt: skip

    def load(
        self,
        boundary: Boundary,
        params: SamplingParams,
        seed: int,
        max_lens: Tensor | None = None,
        rows: tuple[Sequence[int], int] | None = None,
    ) -> None:
        """Takes a new rollout: copies the prompts' KV and lengths in, clears the outputs, rewinds the step.

        max_lens [P, N]: optional per-sequence length budgets (each at most params.max_tokens). rows (index,
        total): the sequences are rows `index` of a step of `total` (a data-parallel rank's share, `check_rows`),
        and each draws the random numbers that row draws in a one-process rollout of the whole step."""
        assert self.shape.fits(boundary, self.shape.num_samples, params), "the rollout exceeds the decode shape"
        length = boundary.max_prompt_len
        for dst_k, dst_v, k, v in zip(self.prompt_k, self.prompt_v, boundary.keys, boundary.values, strict=True):
            dst_k[:, :, :length].copy_(k)
            dst_v[:, :, :length].copy_(v)
        self.prompt_lens.copy_(boundary.prompt_lens)
        self.next_positions[:-1].copy_(boundary.next_positions)
        self.step.zero_()
        for t in (self.tokens, self.logprobs, self.done):
            t.zero_()
        self.max_lens.fill_(self.shape.max_tokens)
        if max_lens is not None:
            self.max_lens[:-1].copy_(max_lens.flatten().clamp(1, self.shape.max_tokens))
        self.seed.fill_(seed)
        index, total = rows if rows is not None else (range(self.shape.num_slots - 1), self.shape.num_slots - 1)
        self.batch_rows.copy_(torch.tensor([*index, total]))  # the spare slot: the whole batch's spare
        self.batch_slots.fill_(total + 1)
        self.temperature.fill_(params.temperature)
        if self.shape.fused_sampling:
            self.stop_ids.fill_(-1)
            self.stop_ids[: len(params.stop_token_ids)] = torch.tensor(params.stop_token_ids)

    def sample(self, logits: Tensor, slots: Tensor, column: Tensor) -> None:
        """Fused sampling of token `column` for the sequences in `slots` from logits [rows, V]."""
        fused_sample(
            logits, slots, column, self.seed, self.temperature, self.stop_ids, self.tokens, self.logprobs,
            self.last_token, self.done, self.max_lens, self.batch_rows, self.batch_slots,
        )  # fmt: skip

    def forward(self, rows: int, prompts: int | None = None) -> Tensor:
        """One step for batch rows [0, rows): logits [rows, V] of the token after each row's last token. prompts:
        how many prompts the rows span (the first of `batch_prompts`); by default every prompt of the shape."""
        prompts = self.shape.num_prompts if prompts is None else prompts
        lm = self.model.model.language_model
        text = self.model.config.text
        eps = text.rms_norm_eps
        slots = self.slots[:rows]
        residual = lm.embed_tokens(self.last_token[slots])  # [rows, hidden]
        normed = torch.empty_like(residual)
        heads = self.weights[0].num_heads
        q_rot = torch.empty(rows, heads, text.head_dim, dtype=residual.dtype, device=slots.device)
        attended = torch.empty_like(q_rot)
        delta, pdl, ahead = None, self.weights[0].kernels.pdl, self.weights[0].kernels.ahead
        for i, (layer, w) in enumerate(zip(lm.layers, self.weights, strict=True)):
            add_rms_norm(delta, residual, layer.input_layernorm.weight, eps, normed, pdl, ahead)
            qkv = w.qkv(normed)  # parts [S, rows, (H + 2G) D]
            rotary_to_cache(
                qkv, self.cos, self.sin, slots, self.next_positions, self.step, q_rot,
                self.k_cache[i], self.v_cache[i], self.shape.num_samples, pdl, ahead,
            )  # fmt: skip
            self.attention(
                q_rot, self.prompt_k[i], self.prompt_v[i], self.prompt_lens, self.row_start, self.row_count,
                self.k_cache[i], self.v_cache[i], slots, self.step, attended, self.batch_prompts, prompts, pdl, ahead,
            )  # fmt: skip
            out = w.out(attended.view(rows, -1))
            add_rms_norm(out, residual, layer.post_attention_layernorm.weight, eps, normed, pdl, ahead)
            delta = w.mlp(normed)  # parts [S, rows, hidden], added by the next norm
        add_rms_norm(delta, residual, lm.norm.weight, eps, normed, pdl, ahead)
        logits = self._logits(normed, rows)
        self.step += 1
        if self.shape.fused_sampling:
            self.sample(logits, slots, self.step)  # the token after token `step - 1` is token `step`
        return logits

    def _logits(self, normed: Tensor, rows: int) -> Tensor:
        """Full logits [rows, V] into `self.logits`; a rollout group gathers its vocabulary shards."""
        head = self.model.lm_head.weight.detach()
        if self.group.size == 1:
            return torch.matmul(normed, head.t(), out=self.logits[:rows])
        parts = self.logit_parts[: rows * self.logits.shape[1]].view(self.group.size, rows, -1)
        torch.matmul(normed, head.t(), out=parts[self.group.rank])
        all_gather_into(parts.flatten(0, 1), parts[self.group.rank], self.group)
        logits = self.logits[:rows]
        logits.view(rows, self.group.size, -1).copy_(parts.transpose(0, 1))
        return logits
