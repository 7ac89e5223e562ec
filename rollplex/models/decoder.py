"""The language decoder of Qwen2.5-VL (Qwen2): token embedding, pre-norm layers of grouped-query attention
with QKV bias and a SwiGLU MLP, final RMSNorm. Parameter names follow HF (`layers.{i}.self_attn.q_proj`, ...).

How the new tokens attend (to each other, to a shared prompt, to a cache) is the caller's `Attention`; the
decoder only projects, rotates and mixes. Not here: the LM head and the vision embeddings (`model.py`).
"""

from __future__ import annotations

from torch import Tensor, nn

from rollplex.models.attention import Attention
from rollplex.models.config import TextConfig
from rollplex.models.layers import GatedMLP, RMSNorm
from rollplex.models.packing import packed_linear
from rollplex.models.rotary import split_rotated


class SelfAttention(nn.Module):
    def __init__(self, text: TextConfig) -> None:
        super().__init__()
        self.num_heads = text.num_attention_heads
        self.num_kv_heads = text.num_key_value_heads
        self.head_dim = text.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(text.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(text.hidden_size, kv_width, bias=True)
        self.v_proj = nn.Linear(text.hidden_size, kv_width, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, text.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Attention, layer: int) -> Tensor:
        """x [B, T, hidden], cos/sin [B, 1, T, D] -> [B, T, hidden]."""
        return self.output(attention(layer, *self.project(x, cos, sin)), x.shape[1])

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, hidden] -> the attention's rotated q [B, heads, T, D], rotated k and v [B, kv_heads, T, D]."""
        return split_rotated(packed_linear(x, (self.q_proj, self.k_proj, self.v_proj)), cos, sin, self.num_heads)

    def output(self, out: Tensor, rows: int) -> Tensor:
        """The attention's output [B, heads, T, D] -> o_proj's [B, T, hidden] (`rows`: T, the input's rows)."""
        batch, num_tokens = out.shape[0], out.shape[2]
        return self.o_proj(out.transpose(1, 2).reshape(batch, num_tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, text: TextConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.self_attn = SelfAttention(text)
        self.mlp = GatedMLP(text.hidden_size, text.intermediate_size, bias=False)
        self.input_layernorm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(text.hidden_size, text.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Attention) -> Tensor:
        return self.after_attention(x, attention(self.index, *self.before_attention(x, cos, sin)))

    def before_attention(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The layer up to its attention: q, k, v of the normed input (`SelfAttention.project`)."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def after_attention(self, x: Tensor, out: Tensor) -> Tensor:
        """The layer from its attention's output `out` on: o_proj and the residual, the MLP and its residual.
        Selective recompute (`memory.offload.recompute_methods`) reruns these two halves and keeps what the
        attention between them saves; `layers.compile_halves` compiles each as a region."""
        x = x + self.self_attn.output(out, x.shape[1])
        return x + self.mlp(self.post_attention_layernorm(x))


class SequenceRegion:
    """Where the rows of the hidden state live from the decoder's first layer through its final norm: all of them
    in this process (this class), or a share of them on each tensor-parallel rank (`parallel.model`'s sequence
    parallelism). `enter` takes the embeddings [B, T, hidden] into the region, `leave` gives the whole T rows
    of the final norm's output back; every layer in between sees only what `enter` returned."""

    def enter(self, x: Tensor) -> Tensor:
        return x

    def leave(self, x: Tensor, length: int) -> Tensor:
        return x


class TextDecoder(nn.Module):
    def __init__(self, text: TextConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(text, index) for index in range(text.num_hidden_layers))
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.region = SequenceRegion()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Attention) -> Tensor:
        """Input embeddings x [B, T, hidden] -> final normed hidden states [B, T, hidden]."""
        length, x = x.shape[1], self.region.enter(x)
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        return self.region.leave(self.norm(x), length)
