"""Where K/V live between steps: the KV-cache protocol and its single-machine caches.

Every cache answers the seed's call

    keys, values, offset, mask = cache.update_and_fetch(k, v, mask_length=L, mask=mask)

with k, v the new (B, Hkv, L, D) entries. It stores them and returns the whole visible
history (B, Hkv, S, D), the offset the new entries were written at, and the mask that
goes with the history: None, "causal" (bottom-right aligned) or a boolean
(B, 1, L, S) tensor where True means "may attend". The caches are storage: the reference
attention backend (`qinfer.attention.reference`) makes that call and attends over what it
returns, and never asks which kind of cache it got.

Batched rows of different lengths are left-padded: row b starts with left_padding[b]
pad tokens whose keys no real query may see. Positions are counted per row from its
first real token, so a pad slot has a negative position; the mask is built from
positions on every step:

    allowed[q, k] = 0 <= pos_k <= pos_q  (and pos_q - pos_k < window for sliding layers)

plus pos_k == pos_q, which lets a pad query see itself so that no row of the softmax
is empty (an all-masked row would be NaN and poison the pad slot's K/V in later layers).
The caches of one model (`Transformer.make_cache`) share a `StepMasks`, so that mask is
built once per step for all the layers of one window rather than once per layer.

A cache given a `KVFormat` (`qinfer.attention.kv_quant`) stores K/V in it: a quantized one keeps
int8 or fp8 elements in `keys`/`values` and N fp16 scales per (row, head, position), one
per block of 32 elements, in `key_scales`/`value_scales` (B, Hkv, positions, N), quantizes
each step's entries as it writes them, and returns the history dequantized to the
entries' dtype. The entries of the step itself come back as stored too, so a sequence fed
whole or in pieces sees the same K/V.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qinfer.attention.kv_quant import KVFormat
from qinfer.attention.sdpa import Mask
from qinfer.core.errors import CacheError

_EMPTY = -(2**30)  # position of a ring slot that holds nothing yet

#: Contiguous caches grow their buffers by this many positions at a time.
GROWTH_STEP = 256


def position_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """(B, 1, L, S) boolean mask from query positions (B, L) and key positions (B, S)."""
    q = query_positions[:, None, :, None]  # (B, 1, L, 1)
    k = key_positions[:, None, None, :]  # (B, 1, 1, S)
    allowed = k >= 0
    if causal:
        allowed = allowed & (k <= q)
    if window is not None:
        allowed = allowed & (q - k < window)
    return allowed | (k == q)


class StepMasks:
    """The masks of the current step, shared by the caches of one model's layers.

    Those caches hold the same rows, padding and positions, so in one step every layer with
    the same window (None: full attention) builds the identical (B, 1, L, S) mask: the
    first builds it, the others reuse it. A step is named by (slots written after it, L);
    `forget` drops the masks when rows or positions change between steps.
    """

    def __init__(self) -> None:
        self._step: tuple[int, int] | None = None
        self._masks: dict[tuple[int | None, bool], torch.Tensor] = {}

    def get(
        self,
        step: tuple[int, int],
        window: int | None,
        causal: bool,
        build: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """This step's mask for `window` and `causal`, from `build()` the first time."""
        if step != self._step:
            self.forget()
            self._step = step
        key = (window, causal)
        if key not in self._masks:
            self._masks[key] = build()
        return self._masks[key]

    def forget(self) -> None:
        self._step = None
        self._masks.clear()


class _Cache:
    """What every single-machine cache shares: offsets, left padding, the position limit."""

    #: The attributes holding one entry per batch row, first dimension B (see `select`).
    _row_buffers: tuple[str, ...] = ("keys", "values", "key_scales", "value_scales")

    def __init__(
        self,
        batch_size: int,
        max_length: int,
        window: int | None,
        left_padding: torch.Tensor | list[int] | None,
        step_masks: StepMasks | None,
        kv_format: KVFormat | None,
    ) -> None:
        self.batch_size = batch_size
        self.max_length = max_length
        self.window = window
        self.offset = 0  # slots written per row, pad slots included
        if left_padding is not None:
            left_padding = torch.as_tensor(left_padding, dtype=torch.long)
            if left_padding.shape != (batch_size,):
                raise CacheError(
                    f"left_padding has shape {tuple(left_padding.shape)}, expected ({batch_size},)"
                )
        self.left_padding = left_padding
        # Shared with the other layers' caches when made together (make_cache).
        self.step_masks = step_masks if step_masks is not None else StepMasks()
        self.kv_format = kv_format  # None: K/V stored as they come
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.key_scales: torch.Tensor | None = None  # (B, Hkv, positions, N), quantized only
        self.value_scales: torch.Tensor | None = None

    def _allocate(self, k: torch.Tensor, positions: int) -> None:
        """Zeroed buffers for `positions` entries like k (B, Hkv, L, D), in the cache's
        format; what the old ones held up to `offset` is copied over."""
        B, H, _, D = k.shape
        fmt = self.kv_format
        dtype = k.dtype if fmt is None else fmt.dtype
        scaled = fmt is not None and fmt.quantized
        old = [self.keys, self.values, self.key_scales, self.value_scales]
        self.keys = k.new_zeros(B, H, positions, D, dtype=dtype)
        self.values = k.new_zeros(B, H, positions, D, dtype=dtype)
        N = fmt.scales_per_vector(D) if scaled else 0
        scales = lambda: k.new_zeros(B, H, positions, N, dtype=fmt.scale_dtype)  # noqa: E731
        self.key_scales, self.value_scales = (scales(), scales()) if scaled else (None, None)
        new = [self.keys, self.values, self.key_scales, self.value_scales]
        for before, after in zip(old, new, strict=True):
            if before is not None and after is not None:
                after[:, :, : self.offset] = before[:, :, : self.offset]

    def _store(self, index: slice | torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v (B, Hkv, L, D) at the L positions `index` of the buffers."""
        if self.key_scales is None:  # stored as they come, in the buffers' dtype
            self.keys[:, :, index] = k.to(self.keys.dtype)
            self.values[:, :, index] = v.to(self.values.dtype)
            return
        for data, scales, x in (
            (self.keys, self.key_scales, k),
            (self.values, self.value_scales, v),
        ):
            data[:, :, index], scales[:, :, index] = self.kv_format.quantize(x)

    def _fetch(self, index: slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K, V (B, Hkv, S, D) at positions `index`, in `dtype`: views of the buffers
        when they hold that dtype unscaled, else dequantized copies."""
        keys, values = self.keys[:, :, index], self.values[:, :, index]
        if self.key_scales is None and keys.dtype == dtype:
            return keys, values
        fmt = self.kv_format
        key_scales = None if self.key_scales is None else self.key_scales[:, :, index]
        value_scales = None if self.value_scales is None else self.value_scales[:, :, index]
        return fmt.dequantize(keys, key_scales, dtype), fmt.dequantize(values, value_scales, dtype)

    def _round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, Hkv, L, D) as this cache gives back what it stored."""
        return x if self.kv_format is None else self.kv_format.round_trip(x)

    @property
    def offsets(self) -> int | torch.Tensor:
        """RoPE position of each row's next token: an int, or (B,) when rows are padded."""
        if self.left_padding is None:
            return self.offset
        return self.offset - self._padding_on(self._device())

    def _device(self) -> torch.device:
        return self.keys.device if self.keys is not None else torch.device("cpu")

    def _padding_on(self, device: torch.device) -> torch.Tensor:
        """left_padding (B,) on `device`, moved there once rather than copied at every step."""
        if self.left_padding.device != device:
            self.left_padding = self.left_padding.to(device)
        return self.left_padding

    def select(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only these batch rows (rows of a batch that finished stop costing work)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        if rows.dim() != 1 or (
            len(rows) and not 0 <= int(rows.min()) <= int(rows.max()) < self.batch_size
        ):
            raise CacheError(
                f"select() takes row indices in 0..{self.batch_size - 1}, got {rows.tolist()}"
            )
        for name in self._row_buffers:
            buffer = getattr(self, name)
            if buffer is not None:
                setattr(self, name, buffer[rows.to(buffer.device)])
        if self.left_padding is not None:
            self.left_padding = self.left_padding[rows.to(self.left_padding.device)]
        self.batch_size = len(rows)
        self.step_masks.forget()

    def _check_step(self, k: torch.Tensor) -> None:
        """Refuse new entries k (B, Hkv, L, D) of another batch size or past max_length."""
        B, L = k.shape[0], k.shape[2]
        if B != self.batch_size:
            raise CacheError(f"KV cache holds {self.batch_size} batch rows; this step has {B}")
        needed = self.offset + L
        if needed > self.max_length:
            raise CacheError(
                f"KV cache holds at most {self.max_length} positions; "
                f"this step needs {needed} ({self.offset} cached + {L} new)"
            )

    def _slot_positions(self, slots: torch.Tensor) -> torch.Tensor:
        """Positions (B, n) of stream slots (n,) once left padding is taken away."""
        positions = slots[None, :].expand(self.batch_size, -1)
        if self.left_padding is not None:
            positions = positions - self._padding_on(slots.device)[:, None]
        return positions

    def _mask(
        self,
        mask: Mask,
        query_slots: torch.Tensor,
        key_positions: Callable[[], torch.Tensor],
    ) -> Mask:
        """The caller's mask ("causal", None or a boolean tensor) merged with padding/window.

        query_slots: (L,) stream slots of this step's tokens; key_positions: makes the (B, S)
        positions of the keys (called only when this step's mask is not built yet).
        """
        is_tensor = isinstance(mask, torch.Tensor)
        if is_tensor and mask.dtype != torch.bool:
            raise CacheError(
                "a mask given together with a KV cache must be boolean (True = attend)"
            )
        causal = isinstance(mask, str)

        def build() -> torch.Tensor:
            query_positions = self._slot_positions(query_slots)
            return position_mask(query_positions, key_positions(), self.window, causal=causal)

        if is_tensor:  # the caller's own mask may differ per call: nothing to share
            return build() & mask
        step = (self.offset, len(query_slots))
        return self.step_masks.get(step, self.window, causal, build)


class KVCache(_Cache):
    """A preallocated contiguous cache (B, Hkv, capacity, D) that grows in chunks.

    Appending never concatenates the whole history: the buffers grow by GROWTH_STEP
    positions at a time (a copy amortised over many steps) and each step writes in place.
    """

    def __init__(
        self,
        batch_size: int = 1,
        max_length: int = 4096,
        left_padding: torch.Tensor | list[int] | None = None,
        step_masks: StepMasks | None = None,
        kv_format: KVFormat | None = None,
    ) -> None:
        super().__init__(batch_size, max_length, None, left_padding, step_masks, kv_format)
        # keys, values: (B, Hkv, capacity, D), made at the first step

    def _grow(self, k: torch.Tensor, needed: int) -> None:
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if needed <= capacity:
            return
        self._allocate(k, min(self.max_length, -(-needed // GROWTH_STEP) * GROWTH_STEP))

    def update_and_fetch(
        self, k: torch.Tensor, v: torch.Tensor, mask_length: int | None = None, mask: Mask = None
    ) -> tuple[torch.Tensor, torch.Tensor, int, Mask]:
        """Append k, v (B, Hkv, L, D); return the history (B, Hkv, offset + L, D)."""
        L = k.shape[2]
        self._check_step(k)
        self._grow(k, self.offset + L)
        start = self.offset
        self._store(slice(start, start + L), k, v)
        self.offset += L
        keys, values = self._fetch(slice(0, self.offset), k.dtype)
        if self.left_padding is None and (mask is None or isinstance(mask, str)):
            # No padding: the bottom-right causal rule says it all (and keeps fast paths).
            return keys, values, start, (mask if L > 1 else None)
        slots = torch.arange(self.offset, device=k.device)
        mask = self._mask(mask, slots[start:], lambda: self._slot_positions(slots))
        return keys, values, start, mask

    def trim(self, n: int) -> int:
        """Forget the last n positions (speculative decoding, prefix reuse); returns how many."""
        n = min(n, self.offset)
        self.offset -= n
        self.step_masks.forget()
        return n

    def reset(self) -> None:
        self.offset = 0
        self.step_masks.forget()


class RotatingKVCache(_Cache):
    """A ring of `window` slots for sliding-window layers: memory stays O(window).

    Decoding one token writes it over the slot of the token that just left the window
    and returns the ring as it is (attention does not care about key order; the mask
    is built from the positions each slot holds). A multi-token step returns the ring
    followed by the new tokens, so every query sees its whole window, then keeps the
    newest `window` tokens. Until the ring first wraps, slot i holds token i and only
    the slots in use are returned; a cache for fewer positions than the window (a single
    forward pass) gets a ring of that many slots.
    """

    _row_buffers = (*_Cache._row_buffers, "slot_positions")

    def __init__(
        self,
        window: int,
        batch_size: int = 1,
        max_length: int = 4096,
        left_padding: torch.Tensor | list[int] | None = None,
        step_masks: StepMasks | None = None,
        kv_format: KVFormat | None = None,
    ) -> None:
        super().__init__(batch_size, max_length, window, left_padding, step_masks, kv_format)
        self.size = min(window, max_length)  # ring slots
        # keys, values: (B, Hkv, size, D), made at the first step
        self.slot_positions: torch.Tensor | None = None  # (B, size) position held per slot

    def update_and_fetch(
        self, k: torch.Tensor, v: torch.Tensor, mask_length: int | None = None, mask: Mask = None
    ) -> tuple[torch.Tensor, torch.Tensor, int, Mask]:
        """Store k, v (B, Hkv, L, D); return the ring's slots in use (B, Hkv, <= size, D)
        for L == 1, else those followed by the L new entries, with the mask that keeps
        each query inside its window."""
        B, H, L, D = k.shape
        self._check_step(k)
        if self.keys is None:
            self._allocate(k, self.size)
            self.slot_positions = torch.full(
                (B, self.size), _EMPTY, dtype=torch.long, device=k.device
            )
        start = self.offset
        slots = torch.arange(start, start + L, device=k.device)  # stream index of each new token
        new_positions = self._slot_positions(slots)  # (B, L)
        if L == 1:
            self._write(k, v, slots, new_positions)
            used = min(start + 1, self.size)
            keys, values = self._fetch(slice(0, used), k.dtype)
            key_positions = self.slot_positions[:, :used]
        else:
            used = min(start, self.size)
            ring_keys, ring_values = self._fetch(slice(0, used), k.dtype)
            keys = torch.cat([ring_keys, self._round_trip(k)], dim=2)
            values = torch.cat([ring_values, self._round_trip(v)], dim=2)
            key_positions = torch.cat([self.slot_positions[:, :used], new_positions], dim=1)
            keep = slice(max(0, L - self.size), L)  # only the newest tokens stay in the ring
            self._write(k[:, :, keep], v[:, :, keep], slots[keep], new_positions[:, keep])
        self.offset += L
        return keys, values, start, self._mask(mask, slots, lambda: key_positions)

    def _write(self, k, v, slots: torch.Tensor, positions: torch.Tensor) -> None:
        ring = slots % self.size
        self._store(ring, k, v)
        self.slot_positions[:, ring] = positions

    # The buffers are made inside the model's inference mode; writing into them from
    # outside it (trim, reset between requests) must enter that mode again.
    @torch.inference_mode()
    def trim(self, n: int) -> int:
        """Forget the last n positions; only possible while nothing has been overwritten."""
        n = min(n, self.offset)
        if self.offset > self.size:
            raise CacheError(
                f"cannot rewind a sliding-window cache past its window ({self.window} tokens)"
            )
        self.offset -= n
        if self.slot_positions is not None:
            self.slot_positions[:, self.offset : self.offset + n] = _EMPTY
        self.step_masks.forget()
        return n

    @torch.inference_mode()
    def reset(self) -> None:
        self.offset = 0
        self.step_masks.forget()
        if self.slot_positions is not None:
            self.slot_positions.fill_(_EMPTY)
