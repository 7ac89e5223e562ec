"""`Qwen2_5_VL`: the vision-language model, callable whole or split at the first response position.

- `forward(sequences)`: logits of whole sequences (prompt, or prompt ++ response): the unsplit path;
  `hidden(sequences)`: the same before the LM head.
- `prefix(prompts, attached=...)`: vision encoder + prompt prefill, once per prompt -> `Boundary`.
- `suffix(boundary, responses, response_lens)`, `suffix_rows(...)`: per-token log-probs and entropy of
  responses, each attending to its prompt's shared boundary KV (never copied per response), their tokens
  packed end to end (`packed_hidden`).
- `response_logits(boundary, tokens, cache)`: rollout decode's forward; `response_hidden(...)`: the same before
  the LM head.

Parameter names are transformers 5.x's `Qwen2_5_VLForConditionalGeneration` names (`model.visual.*`,
`model.language_model.*`, `lm_head.weight`). Not here: loading weights (`checkpoint.py`), sampling
(`generate.py`).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
from torch import Tensor, nn

from rollplex.models.attention import Attention, CausalAttention, LayerKV, SharedPrefixAttention
from rollplex.models.batching import PackedSequences
from rollplex.models.boundary import Boundary, concat_boundaries
from rollplex.models.cache import ResponseCache
from rollplex.models.chunks import drain, each_inside
from rollplex.models.config import ModelConfig
from rollplex.models.cudnn_ragged import SuffixKernels, scoring_attention
from rollplex.models.decoder import SelfAttention, TextDecoder
from rollplex.models.inputs import Prompt, to_device
from rollplex.models.packed import ResponsePack
from rollplex.models.packing import pack
from rollplex.models.positions import num_visual_tokens
from rollplex.models.prompt_inputs import PromptInputs, prompt_inputs
from rollplex.models.prompt_rows import PackedPromptKV, prompt_dense
from rollplex.models.rerun import Rerun, run_unit
from rollplex.models.rotary import text_rotary
from rollplex.models.scores import SuffixOut, join_first, token_scores
from rollplex.models.shared_vision import SharedVision
from rollplex.models.vision import VisionEncoder, VisionMLP

INIT_STD = 0.02  # `initializer_range` of every released Qwen2.5-VL config


class Backbone(nn.Module):
    """The two towers under HF's names: `model.visual` and `model.language_model`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.visual = VisionEncoder(config.vision)
        self.language_model = TextDecoder(config.text)


class Qwen2_5_VL(nn.Module):
    """Qwen2.5-VL with random weights (seeded by `torch.manual_seed`) until a checkpoint is loaded.

    `device="meta"` allocates nothing (see `checkpoint.load_pretrained`). Parameters hold `dtype`; norms,
    rotary, softmax and log-probs compute in float32.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.suffix_kernels: SuffixKernels | None = None  # scoring on cuDNN's ragged calls (`cudnn_ragged`)
        with _default_dtype(dtype), torch.device(device) if device is not None else nullcontext():
            self.model = Backbone(config)  # built in `dtype`: a 32B model never exists in FP32 on the device
            self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        self.init_weights()
        self.tie_weights()
        self.to(dtype)
        self.pack_projections()

    @torch.no_grad()
    def init_weights(self, std: float = INIT_STD) -> None:
        """Random weights as transformers initialises them: N(0, std) matrices, embeddings and patch kernels,
        zero biases, unit norms. (torch's defaults put N(0, 1) in the embedding, which the 3B model's tied
        LM head turns into logits of std ~45: one-hot predictions, zero entropy, zero gradients.)"""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv3d)):
                m.weight.normal_(0.0, std)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
        self.zero_padding()

    def zero_padding(self) -> None:
        """Zeroes what the vision MLPs store beyond transformers' shapes (`VisionMLP`): after an initialisation
        or a load into uninitialised memory, before anything runs."""
        for m in self.modules():
            if isinstance(m, VisionMLP):
                m.zero_padding()

    def tie_weights(self) -> None:
        """Shares the LM head with the token embedding when the config ties them (Qwen2.5-VL-3B)."""
        if self.config.text.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    def pack_projections(self) -> None:
        """Stores each decoder layer's q/k/v weights and biases, and gate/up weights, and each vision block's gate/up
        weights and biases, back to back (`packing.py`). Tensor-parallel layers (`rollplex.parallel`) hold fused
        tensors already and are left as they are."""
        for layer in self.model.language_model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(attn, SelfAttention):
                continue
            pack([attn.q_proj, attn.k_proj, attn.v_proj], "weight")
            pack([attn.q_proj, attn.k_proj, attn.v_proj], "bias")
            pack([mlp.gate_proj, mlp.up_proj], "weight")
        for block in self.model.visual.blocks:
            pack([block.mlp.gate_proj, block.mlp.up_proj], "weight")
            pack([block.mlp.gate_proj, block.mlp.up_proj], "bias")

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(self, sequences: Sequence[Prompt]) -> Tensor:
        """Logits [B, L, V] of right-padded whole sequences; rows past a sequence's length are meaningless."""
        return self.lm_head(self.hidden(sequences))

    def hidden(self, sequences: Sequence[Prompt]) -> Tensor:
        """Final hidden states [B, L, hidden] under `forward` (before the LM head)."""
        hidden, _ = self._run_sequences(sequences, CausalAttention())
        return hidden

    def prefix(self, prompts: Sequence[Prompt], *, attached: bool) -> Boundary:
        """Runs each prompt once: vision encoder and prefill.

        `attached=False` (reference) runs under no_grad; `attached=True` (actor) keeps the graph, so a loss on
        suffix log-probs reaches the prompt's decoder layers, the merger and the vision encoder.
        """
        num_layers = self.config.text.num_hidden_layers
        return drain(self.prefix_chunks(prompts, attached=attached, layers_per_chunk=num_layers))

    def prefix_chunks(
        self,
        prompts: Sequence[Prompt],
        *,
        attached: bool,
        layers_per_chunk: int = 1,
        prompts_per_chunk: int | None = None,
        rerun: Rerun | None = None,
        vision: SharedVision | None = None,
        inputs_first: bool = False,
        attached_prompts: int | None = None,
    ) -> Generator[None, None, Boundary]:
        """`prefix` as a generator that pauses between chunks of its work, so that a scheduler can interleave it
        with other work (rollout decode): per group of `prompts_per_chunk` prompts (default: all, one batch), the
        embedding and vision encoder (`layers_per_chunk` vision blocks at a time), then `layers_per_chunk` decoder
        layers at a time; then the boundary of all
        prompts, which it returns. The grad mode is entered and left inside each chunk, never held across a
        pause. With one group, the same work as `prefix`, in the same order. `rerun` (attached only): each
        vision block and decoder layer keeps only its input, and backward reruns it (`rollplex.models.rerun`).
        `vision` (a frozen tower): the prompts' vision output comes from it, run there once per step.
        `inputs_first`: every group's inputs are copied to the device before the first group runs (for a prefix
        beside other copies on the host link, `prompt_inputs`); else each group's as it starts.
        `attached_prompts` (attached only): the first this many prompts keep their graph and the rest run without
        (their own groups), as for the step's prefix of mini-batches, whose first alone backpropagates through it."""
        size = prompts_per_chunk or len(prompts)
        shared = vision is not None
        cut = len(prompts) if attached_prompts is None or not attached else attached_prompts
        bounds = [
            (i, min(i + size, stop))
            for start, stop in ((0, cut), (cut, len(prompts)))
            for i in range(start, stop, size)
        ]
        batches = [prompts[a:b] for a, b in bounds]
        if inputs_first:
            batches = [prompt_inputs(self, batch, shared) for batch in batches]
        groups: list[_GroupPrefix] = []
        for i, batch in enumerate(batches):
            if groups:
                yield  # each group's embedding and vision encoder start a chunk of their own
            group = _GroupPrefix(self, attached and bounds[i][0] < cut, rerun, vision)
            batches[i] = None  # a group's patches are the tower's to free once it has run
            inputs = batch if inputs_first else prompt_inputs(self, batch, shared)
            yield from group.start(inputs, blocks_per_chunk=layers_per_chunk)
            groups.append(group)
        layers = self.model.language_model.layers
        for start in range(0, len(layers), layers_per_chunk):
            for group in groups:
                yield
                group.run(layers[start : start + layers_per_chunk])
        parts = [group.boundary() for group in groups]
        with torch.enable_grad() if attached else torch.no_grad():  # the caller may drain it under no_grad (decode)
            return concat_boundaries(parts)

    def suffix(
        self, boundary: Boundary, responses: Tensor, response_lens: Tensor, temperature: float = 1.0
    ) -> SuffixOut:
        """Scores responses [P, N, R] int64 of lengths [P, N] at `temperature` (`rollplex.models.scores`);
        padding may hold any valid token id."""
        if responses.ndim != 3 or responses.shape[0] != boundary.num_prompts or responses.shape[2] == 0:
            expected = f"[num_prompts={boundary.num_prompts}, N, R >= 1]"
            raise ValueError(f"responses must be {expected}, got {tuple(responses.shape)}")
        num_prompts, num_samples, _ = responses.shape
        rows = [p for p in range(num_prompts) for _ in range(num_samples)]
        lens = response_lens.flatten().tolist()
        out = self.suffix_rows(boundary, rows, responses.flatten(0, 1), lens, temperature)
        return SuffixOut(out.logprobs.unflatten(0, (num_prompts, num_samples)),
                         out.entropy.unflatten(0, (num_prompts, num_samples)))  # fmt: skip

    def suffix_rows(
        self,
        boundary: Boundary,
        rows: Sequence[int],
        responses: Tensor,
        lens: Sequence[int],
        temperature: float = 1.0,
    ) -> SuffixOut:
        """Scores [B, R] of responses [B, R] of lengths `lens`, row b a response to prompt rows[b] of the
        boundary: a batch may mix the responses of several prompts. Rows and lengths are host integers. The
        tokens that predict each response's next run packed (`response_pack`): padding never reaches the
        decoder or the LM head."""
        pack = self.response_pack(rows, responses, lens)
        hidden = self.packed_hidden(boundary, pack, pack.gather(responses[:, :-1]))  # [M, hidden]
        targets = pack.gather(responses[:, 1:])
        rest = token_scores(hidden, self.lm_head, targets, self.config.text.vocab_size, temperature)
        rows_lens = to_device(torch.tensor([list(rows), list(lens)], dtype=torch.long), self.device)
        first = boundary.first_logprobs.index_select(0, rows_lens[0])
        lens_now = rows_lens[1].to(responses.device)
        return join_first(first, pack.scatter(rest[0]), pack.scatter(rest[1]), responses, lens_now, temperature)

    def response_pack(self, rows: Sequence[int], responses: Tensor, lens: Sequence[int]) -> ResponsePack:
        """The tokens of responses [B, R] of lengths `lens` that predict a next token of theirs: the first
        lens[b] - 1 of row b (token 0 is predicted by the boundary)."""
        if responses.ndim != 2 or len(rows) != responses.shape[0] or responses.shape[1] == 0:
            raise ValueError(f"responses must be [B, R >= 1] with B rows, got {tuple(responses.shape)}, "
                             f"{len(rows)} rows")  # fmt: skip
        width = responses.shape[1]
        if len(lens) != len(rows) or any(not 0 <= n <= width for n in lens):
            raise ValueError(f"one length in [0, {width}] per row, got {list(lens)}")
        return ResponsePack.of(rows, [max(n - 1, 0) for n in lens], width - 1, self.device)

    def packed_hidden(self, boundary: Boundary, pack: ResponsePack, tokens: Tensor) -> Tensor:
        """Final hidden states [M, hidden] of a pack's tokens [M] (`PackedPrefixAttention`): token t of row b at
        response position t after prompt rows[b]."""
        x = self.model.language_model.embed_tokens(tokens)
        if pack.num_tokens == 0:
            return x
        positions = boundary.next_positions.index_select(0, pack.prompt) + pack.offset  # [M]
        cos, sin = text_rotary(positions.expand(3, 1, -1), self.config.text)
        attention = scoring_attention(boundary, pack, self.suffix_kernels, x, self.config.text.head_dim)
        return self.model.language_model(x[None], cos, sin, attention)[0]

    def whole_response_hidden(self, prompt: Prompt, responses: Tensor, lens: Tensor) -> Tensor:
        """The oracle's hidden states [N, R, hidden]: each of N responses [N, R] of lengths [N] run over
        prompt ++ response (the prompt recomputed each time), at the position before each response token (rows
        past a response's end are meaningless)."""
        num, width = responses.shape
        ids = [
            torch.cat([prompt.input_ids, responses[n, : int(lens[n])].to(prompt.input_ids.device)]) for n in range(num)
        ]
        hidden = self.hidden([Prompt(x, prompt.visuals, response_start=prompt.num_tokens) for x in ids])
        idx = torch.arange(width, device=hidden.device)
        return hidden[:, (prompt.num_tokens - 1 + idx).clamp(max=hidden.shape[1] - 1)]

    def response_logits(self, boundary: Boundary, tokens: Tensor, cache: ResponseCache) -> Tensor:
        """Logits [P, N, T, V] after each of tokens [P, N, T], which continue the N responses of each prompt after
        the cache's `length` tokens (rollout decode); the cache takes their K and V."""
        return self.lm_head(self.response_hidden(boundary, tokens, cache))

    def response_hidden(self, boundary: Boundary, tokens: Tensor, cache: ResponseCache) -> Tensor:
        """The final hidden states [P, N, T, hidden] under `response_logits` (before the LM head)."""
        num_prompts, num_samples, num_tokens = tokens.shape
        rows = torch.arange(num_prompts, device=self.device).repeat_interleave(num_samples)
        attention = SharedPrefixAttention(boundary, num_samples, cache)
        hidden = self._response_rows(boundary, rows, tokens.flatten(0, 1), cache.length, attention)
        cache.advance(num_tokens)
        return hidden.unflatten(0, (num_prompts, num_samples))

    def _response_rows(self, boundary: Boundary, rows: Tensor, tokens: Tensor, start: int, attention) -> Tensor:
        """tokens [B, T] at response positions start.. of prompts rows [B] -> final hidden states [B, T, hidden]."""
        offsets = torch.arange(start, start + tokens.shape[1], device=self.device)
        positions = boundary.next_positions.index_select(0, rows)[:, None] + offsets  # [B, T]
        cos, sin = text_rotary(positions.expand(3, *positions.shape), self.config.text)
        return self.model.language_model(self.model.language_model.embed_tokens(tokens), cos, sin, attention)

    def _run_sequences(self, sequences: Sequence[Prompt], attention: Attention) -> tuple[Tensor, PackedSequences]:
        """Final hidden states [B, L, hidden] of right-padded sequences, and the packed batch."""
        packed, x, cos, sin = self._inputs(sequences)
        return self.model.language_model(x, cos, sin, attention), packed

    def _inputs(self, sequences: Sequence[Prompt]) -> tuple[PackedSequences, Tensor, Tensor, Tensor]:
        """The packed batch, its input embeddings [B, L, hidden] (image/video tokens replaced by the vision
        encoder's outputs) and its rotary cos, sin [B, 1, L, D]."""
        return drain(self._input_chunks(prompt_inputs(self, sequences), blocks_per_chunk=len(self.model.visual.blocks)))

    def _input_chunks(
        self,
        inputs: PromptInputs,
        blocks_per_chunk: int,
        rerun: Rerun | None = None,
        vision: SharedVision | None = None,
    ) -> Generator[None, None, tuple[PackedSequences, Tensor, Tensor, Tensor]]:
        """`_inputs` of inputs already on the device, pausing after every `blocks_per_chunk` vision blocks (each
        under `rerun` if given); the vision output from `vision` when given (`SharedVision`)."""
        packed = inputs.packed
        cos, sin = text_rotary(inputs.positions, self.config.text)
        x = self.model.language_model.embed_tokens(inputs.input_ids)
        if packed.visuals:
            if vision is not None:
                counts = [sum(num_visual_tokens(v, self.config.vision) for v in s.visuals) for s in inputs.prompts]
                compute = partial(self.model.visual.chunks, packed.visuals, blocks_per_chunk)
                features = yield from vision.features(inputs.prompts, counts, compute)
            else:
                features = yield from self.model.visual.chunks(inputs.vision, blocks_per_chunk, rerun)
            x = x.masked_scatter(inputs.slots[..., None], features.to(x.dtype))  # [visual tokens, hidden] in place
        return packed, x, cos, sin


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default floating dtype set to `dtype` inside the block only (restored on the way out)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _layer_kv(
    layer: nn.Module, shape: tuple[int, int, tuple[int, ...]] | None, x: Tensor, cos: Tensor, sin: Tensor, *real: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """A decoder layer as a rerun unit: its output and the K and V it attended with (the boundary's). With
    `shape` (P, L, lens) x holds the packed real rows `real` of P prompts of host lengths `lens` padded to L
    (`PromptRows`)."""
    attention = LayerKV() if shape is None else PackedPromptKV(real[0], *shape, prompt_dense(x.device))
    return layer(x, cos, sin, attention), attention.key, attention.value


class _GroupPrefix:
    """The prefix state of one group of prompts between chunks: hidden states, rotary tables, each layer's KV."""

    def __init__(
        self, model: Qwen2_5_VL, attached: bool, rerun: Rerun | None = None, vision: SharedVision | None = None
    ) -> None:
        self.model, self.num_prompts, self.vision = model, 0, vision
        self.mode = torch.enable_grad if attached else torch.no_grad
        self.keys: list[Tensor] = []  # each layer's K and V, as the boundary holds them
        self.values: list[Tensor] = []
        self.rerun = rerun if attached else None

    def start(self, inputs: PromptInputs, blocks_per_chunk: int) -> Generator[None, None, None]:
        """Embeds the prompts (vision encoder included), pausing between chunks of vision blocks; the grad
        mode is entered around each chunk only."""
        self.num_prompts, self.rows = len(inputs.prompts), inputs.rows  # rows None: no padding to drop
        self.lens, self.next_positions = inputs.lens, inputs.next_positions
        self.host_lens = tuple(inputs.packed.lens.tolist())  # the packing's, on the host: read without a sync
        chunks = self.model._input_chunks(inputs, blocks_per_chunk, self.rerun, self.vision)
        del inputs  # the patches go once the tower has read them
        self.packed, x, cos, sin = yield from each_inside(self.mode, chunks)
        with self.mode():
            if self.rows is not None:  # the layers see the real tokens only, end to end
                x = self.rows.pack(x)
                cos, sin = (self.rows.pack(t[:, 0])[:, None] for t in (cos, sin))  # [1, 1, T, D]
            self.length, self.cos, self.sin = x.shape[1], cos, sin
            self.x = self.model.model.language_model.region.enter(x)  # the rows the layers see

    def run(self, layers: Sequence[nn.Module]) -> None:
        with self.mode():
            rows = self.rows
            shape, real = (None, ()) if rows is None else ((rows.num_prompts, rows.length, rows.lens), (rows.real,))
            for layer in layers:
                unit = partial(_layer_kv, layer, shape)
                self.x, key, value = run_unit(self.rerun, unit, self.x, layer.parameters(), self.cos, self.sin, *real)
                self.keys.append(key)
                self.values.append(value)

    def boundary(self) -> Boundary:
        device = self.model.device
        with self.mode():
            lm = self.model.model.language_model
            hidden = lm.region.leave(lm.norm(self.x), self.length)
            lens = self.lens
            if self.rows is None:
                last = hidden[torch.arange(self.num_prompts, device=device), lens - 1]  # [P, hidden]
            else:
                last = hidden[0].index_select(0, self.rows.last)
            head = self.model.lm_head(last).float()  # [P, V]; a value model's (`values.py`) [P, 1]
            first_logprobs = head if head.shape[-1] == 1 else torch.log_softmax(head, dim=-1)
        return Boundary(
            keys=tuple(self.keys),
            values=tuple(self.values),
            first_logprobs=first_logprobs,
            next_positions=self.next_positions,
            prompt_lens=lens,
            host_prompt_lens=self.host_lens,
        )
