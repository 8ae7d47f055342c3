"""A batched decoder forward over a Hugging Face Llama-family model's own modules.

Why not `model(...)`: continuous batching needs each row to attend to its own slice of a
shared, right-aligned KV cache (see `kv_cache.py`) with its own positions, and joiners to
be prefilled (in chunks, into staging buffers) and then moved into that cache without
touching the other rows. Re-using the HF modules
(projections, norms, MLP, rotary embedding) and writing only the attention plumbing keeps
the arithmetic identical to the HF forward, and the runner checks that numerically at
start-up (`self_check`), so an architecture it does not understand is refused instead of
served wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from liveloop.server.engine.kv_cache import BatchKVCache
from liveloop.server.engine.lora import LoraStep, ModuleKey, apply_linear
from liveloop.server.engine.types import EngineError

LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj")


@dataclass(eq=False)
class Prefill:
    """A prompt being prefilled chunk by chunk into its own K/V buffers `[1, kv, L, dim]`."""

    token_ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    done: int = 0

    @property
    def remaining(self) -> int:
        """Prompt tokens not run yet."""
        return len(self.token_ids) - self.done


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaRunner:
    """Prefill and batched decode steps of a Llama-like causal LM over a `BatchKVCache`."""

    def __init__(self, model: nn.Module) -> None:
        base = getattr(model, "model", None)
        config: Any = getattr(model, "config", None)
        missing = [
            name
            for name, owner in (("model", model), ("lm_head", model), ("config", model))
            if getattr(owner, name, None) is None
        ]
        if base is not None:
            missing += [
                f"model.{n}"
                for n in ("embed_tokens", "layers", "norm", "rotary_emb")
                if getattr(base, n, None) is None
            ]
        if missing:
            raise EngineError(f"torch engine cannot run this model: no {', '.join(missing)}")
        self.model = model
        self.embed: nn.Module = base.embed_tokens  # type: ignore[union-attr]
        self.layers: list[Any] = list(base.layers)  # type: ignore[union-attr]
        self.norm: nn.Module = base.norm  # type: ignore[union-attr]
        self.rotary: nn.Module = base.rotary_emb  # type: ignore[union-attr]
        self.lm_head: nn.Module = model.lm_head  # type: ignore[assignment]
        for i, layer in enumerate(self.layers):
            parts = [p for p in LAYER_PARTS if not hasattr(layer, p)]
            parts += [f"self_attn.{p}" for p in ATTN_PARTS if not hasattr(layer.self_attn, p)]
            if parts:
                raise EngineError(f"torch engine cannot run this model: layer {i} has no {parts}")
        self.num_heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        )
        attn0: Any = self.layers[0].self_attn
        self.scaling = float(getattr(attn0, "scaling", self.head_dim**-0.5))
        self.qk_norm = hasattr(attn0, "q_norm") and hasattr(attn0, "k_norm")
        weight = self.lm_head.weight
        assert isinstance(weight, torch.Tensor)
        self.vocab_size = int(weight.shape[0])
        self.dtype = weight.dtype
        self.device = weight.device
        self.mlp_adaptable = self._check_mlp()

    def _check_mlp(self) -> bool:
        """Whether the MLP is `down(act(gate(x)) * up(x))`, so LoRA can reach its linears."""
        mlp: Any = self.layers[0].mlp
        if not all(hasattr(mlp, p) for p in (*MLP_PARTS, "act_fn")):
            return False
        seeded = torch.Generator().manual_seed(0)
        x = torch.randn(1, 2, int(mlp.gate_proj.weight.shape[1]), generator=seeded)
        x = x.to(device=self.device, dtype=self.dtype)
        with torch.inference_mode():
            ours = mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
            return bool(torch.allclose(ours, mlp(x)))

    def adaptable_linears(self) -> dict[str, tuple[ModuleKey, tuple[int, int]]]:
        """Linears a LoRA adapter may change: module name -> ((layer, proj), (in, out))."""
        names = {id(module): name for name, module in self.model.named_modules()}
        found: dict[str, tuple[ModuleKey, tuple[int, int]]] = {}
        for i, layer in enumerate(self.layers):
            parts = [(layer.self_attn, p) for p in ATTN_PARTS]
            if self.mlp_adaptable:
                parts += [(layer.mlp, p) for p in MLP_PARTS]
            for owner, proj in parts:
                module = getattr(owner, proj)
                weight = getattr(module, "weight", None)
                if id(module) in names and isinstance(weight, torch.Tensor) and weight.dim() == 2:
                    out_f, in_f = (int(d) for d in weight.shape)
                    found[names[id(module)]] = ((i, proj), (in_f, out_f))
        return found

    def new_cache(self, max_rows: int, max_len: int) -> BatchKVCache:
        """An empty cache shaped for this model."""
        return BatchKVCache(
            num_layers=len(self.layers),
            max_rows=max_rows,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_len=max_len,
            dtype=self.dtype,
            device=self.device,
        )

    def _qkv(
        self,
        i: int,
        attn: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: LoraStep | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projected, normalised and rotated q/k/v, each `[batch, heads, seq, head_dim]`."""
        b, s, _ = x.shape
        q = apply_linear(attn.q_proj, x, lora, (i, "q_proj")).view(b, s, -1, self.head_dim)
        k = apply_linear(attn.k_proj, x, lora, (i, "k_proj")).view(b, s, -1, self.head_dim)
        v = apply_linear(attn.v_proj, x, lora, (i, "v_proj"))
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _finish_layer(
        self, i: int, layer: Any, h: torch.Tensor, attn_out: torch.Tensor, lora: LoraStep | None
    ) -> torch.Tensor:
        """Output projection, residuals and MLP; `attn_out` is `[batch, heads, seq, dim]`."""
        b, _, s, _ = attn_out.shape
        merged = attn_out.transpose(1, 2).reshape(b, s, -1)
        h = h + apply_linear(layer.self_attn.o_proj, merged, lora, (i, "o_proj"))
        x = layer.post_attention_layernorm(h)
        mlp = layer.mlp
        if lora is None or not any(lora.adapts((i, p)) for p in MLP_PARTS):
            out: torch.Tensor = h + mlp(x)
            return out
        gate = apply_linear(mlp.gate_proj, x, lora, (i, "gate_proj"))
        up = apply_linear(mlp.up_proj, x, lora, (i, "up_proj"))
        return h + apply_linear(mlp.down_proj, mlp.act_fn(gate) * up, lora, (i, "down_proj"))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.norm(h))
        return out

    def start_prefill(self, token_ids: list[int]) -> Prefill:
        """Staging buffers for a prompt that will be prefilled chunk by chunk."""
        shape = (1, self.kv_heads, len(token_ids), self.head_dim)
        return Prefill(
            token_ids=token_ids,
            keys=[torch.empty(shape, dtype=self.dtype, device=self.device) for _ in self.layers],
            values=[torch.empty(shape, dtype=self.dtype, device=self.device) for _ in self.layers],
        )

    def prefill_step(
        self, state: Prefill, max_tokens: int, lora: LoraStep | None = None
    ) -> torch.Tensor | None:
        """Run the next chunk (at most `max_tokens`) of a prompt; logits `[vocab]` at its end.

        Returns None until the whole prompt has been run. `lora`: the prompt's adapter.
        """
        begin = state.done
        end = min(len(state.token_ids), begin + max(1, max_tokens))
        ids = torch.tensor([state.token_ids[begin:end]], dtype=torch.long, device=self.device)
        pos = torch.arange(begin, end, device=self.device)[None]
        # Query i (position begin + i) sees keys 0..begin + i.
        mask = None
        if begin:
            cols = torch.arange(end, device=self.device)
            mask = cols[None, :] <= pos[0, :, None]
        h = self.embed(ids)
        cos, sin = self.rotary(h, pos)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, layer.self_attn, layer.input_layernorm(h), cos, sin, lora)
            state.keys[i][:, :, begin:end] = k
            state.values[i][:, :, begin:end] = v
            out = F.scaled_dot_product_attention(
                q,
                state.keys[i][:, :, :end],
                state.values[i][:, :, :end],
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scaling,
                enable_gqa=True,
            )
            h = self._finish_layer(i, layer, h, out, lora)
        state.done = end
        return self._logits(h[0, -1]) if end == len(state.token_ids) else None

    def join(self, cache: BatchKVCache, state: Prefill) -> int:
        """Move a fully prefilled prompt into a new row of the batch cache; returns the row."""
        row = cache.add_row(len(state.token_ids))
        for i in range(len(self.layers)):
            cache.write_prefill(i, row, state.keys[i][0], state.values[i][0])
        return row

    def decode(
        self, cache: BatchKVCache, token_ids: list[int], lora: LoraStep | None = None
    ) -> torch.Tensor:
        """One step for every row: feed its last token at its next position; logits `[rows, V]`.

        `lora`: each row's adapter slot (None: every row on the base model).
        """
        n = cache.rows
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device).view(n, 1)
        pos = torch.tensor(cache.lengths, dtype=torch.long, device=self.device).view(n, 1)
        cache.prepare_decode()
        mask = cache.decode_mask()
        h = self.embed(ids)
        cos, sin = self.rotary(h, pos)
        groups = self.num_heads // self.kv_heads
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, layer.self_attn, layer.input_layernorm(h), cos, sin, lora)
            cache.write_decode(i, k[:, :, 0], v[:, :, 0])
            keys, values = cache.window(i)
            # Grouped-query attention without repeating the cache: the query heads that
            # share a kv head become that head's "sequence" of queries.
            q = q.reshape(n, self.kv_heads, groups, self.head_dim)
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling
            )
            out = out.reshape(n, self.num_heads, 1, self.head_dim)
            h = self._finish_layer(i, layer, h, out, lora)
        cache.advance()
        return self._logits(h[:, -1])

    def self_check(self, tolerance: float | None = None) -> float:
        """Compare prefill + batched decode with the HF forward; raise EngineError if off."""
        tol = tolerance if tolerance is not None else (1e-3 if self.dtype == torch.float32 else 0.1)
        seqs = [
            [(7 * i + 3 * j + 1) % self.vocab_size for i in range(n)] for j, n in enumerate((6, 3))
        ]
        cache = self.new_cache(max_rows=2, max_len=16)
        got: list[list[torch.Tensor]] = [[], []]
        for row, seq in enumerate(seqs):
            state = self.start_prefill(seq[:-2])
            while (logits := self.prefill_step(state, 3)) is None:
                pass
            self.join(cache, state)
            got[row].append(logits)
        for step in (2, 1):
            logits = self.decode(cache, [seq[-step] for seq in seqs])
            for row in range(2):
                got[row].append(logits[row])
        worst = 0.0
        for row, seq in enumerate(seqs):
            ref = self.model(torch.tensor([seq], device=self.device)).logits[0, -3:].float()
            mine = torch.stack(got[row]).float()
            worst = max(worst, (ref.log_softmax(-1) - mine.log_softmax(-1)).abs().max().item())
        if not worst <= tol:
            kind = getattr(getattr(self.model, "config", None), "model_type", "?")
            raise EngineError(
                f"torch engine does not reproduce this model's forward ({kind}): "
                f"log-prob difference {worst:.3g} > {tol}"
            )
        return worst
