"""The vocabulary loss a chunk of rows at a time: the same values and gradients as one pass over
every row, and no [rows, V] buffer larger than a chunk in the forward or the backward."""

from __future__ import annotations

import weakref

import pytest
import torch
from test_dflash import random_batch, tiny_verifier, tiny_weights
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from specctl.drafters import DRAFTERS, targets
from specctl.drafters.targets import (
    LOSS_CHUNK_BYTES,
    DenseKept,
    HiddenKept,
    Targets,
    TopKKept,
    batch_targets,
    build_draft_vocab,
    chunked_draft_loss,
    chunked_rows,
    draft_loss,
    loss_chunk_rows,
    targets_from_topk,
    verifier_logits,
    verifier_targets,
    verifier_topk,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

H, POSITIONS, ROWS, CHUNK = 8, 11, 23, 5  # 23 rows read 11 positions (repeats, any order); 5 rows a chunk
REAL_VOCAB = 128_256  # Llama 3's


def test_loss_chunk_rows_is_the_byte_budget_over_a_float32_row(monkeypatch):
    assert LOSS_CHUNK_BYTES == 1 << 30
    assert loss_chunk_rows(REAL_VOCAB) == (1 << 30) // (4 * REAL_VOCAB) == 2092
    assert loss_chunk_rows(1) == 1 << 28
    assert loss_chunk_rows(1 << 40) == 1  # never 0 rows
    with pytest.raises(ValueError, match="vocab_size"):
        loss_chunk_rows(0)
    monkeypatch.setattr(targets, "LOSS_CHUNK_BYTES", 4 * 100 * 7)  # read at each call
    assert loss_chunk_rows(100) == 7


# ---------------------------------------------------------------- the pure chunked loss


def world(vocab: int, kept: int | None, source: str, seed: int = 0, num_rows: int = ROWS):
    """Compact targets of `num_rows` rows over POSITIONS positions (repeats, any order), the same
    targets formed the brute-force way as dense logits (the one-pass reference), t2d, and the
    generator. source: "hidden" (the table keeps the verifier's final hidden states) or "topk"
    (a top-k store's ids and log-probs)."""
    g = torch.Generator().manual_seed(seed)
    norm, lm_head = torch.rand(H, generator=g) + 0.5, torch.randn(vocab, H, generator=g)
    last = torch.randn(POSITIONS, H, generator=g) * 2
    t2d = None if kept is None else build_draft_vocab(torch.rand(vocab, generator=g), kept)[1]
    logits = verifier_logits(last, norm, lm_head, 1e-6)  # [M, V]
    if source == "hidden":
        table = verifier_targets(last, norm, lm_head, 1e-6, t2d, dense_rows=0)
        assert isinstance(table.table, HiddenKept)
    else:
        if t2d is not None:  # most of each row's top 8 inside the draft vocabulary
            logits[:, t2d] += 2.0
        table = targets_from_topk(*targets.topk_compact(logits, 8), t2d, vocab)
        assert isinstance(table.table, TopKKept)
        top = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, logits.topk(8, -1).indices, True)
        logits = logits.masked_fill(~top, float("-inf"))  # a top-k store knows only its top 8
    index = torch.randint(0, POSITIONS, (num_rows,), generator=g)
    kept_logits = logits[index] if t2d is None else logits[index][:, t2d]
    dense = Targets.dense(kept_logits, logits.argmax(-1)[index], table.logsumexp[index])
    return table[index], dense, t2d, g


def loss_and_grads(target, t2d, kind, chunk_rows, seed=7):
    """Weighted sum of the chunked per-row loss of a trainable head over trainable hidden rows,
    -> (loss rows, correct, valid, grad of the hidden rows, grad of the head)."""
    g = torch.Generator().manual_seed(seed)
    width = target.table.width
    head = nn.Linear(H, width, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(width, H, generator=g))
    hidden = torch.randn(len(target), H, generator=g).requires_grad_()
    weights = torch.rand(len(target), generator=g)  # every row's gradient differs
    loss, correct, valid = chunked_draft_loss(head, hidden, target, t2d, kind, chunk_rows)
    (loss * weights).sum().backward()
    return loss.detach(), correct, valid, hidden.grad, head.weight.grad


@pytest.mark.parametrize("vocab,kept", [(97, None), (97, 40), (REAL_VOCAB, None), (REAL_VOCAB, 32_000)])
@pytest.mark.parametrize("source", ["hidden", "topk"])
@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_chunked_loss_equals_one_pass_in_value_and_gradient(vocab, kept, source, kind):
    """5-row chunks (the last one short) over compact targets vs one pass over formed targets:
    the same loss, correctness, validity, and gradients w.r.t. the hidden rows and the head."""
    rows, dense, t2d, _ = world(vocab, kept, source)
    want = loss_and_grads(dense, t2d, kind, chunk_rows=ROWS)
    got = loss_and_grads(rows, t2d, kind, chunk_rows=CHUNK)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[4], want[4], rtol=1e-5, atol=1e-5)
    assert want[3].abs().sum() > 0 and want[4].abs().sum() > 0  # something to compare
    if source == "topk" and kind == "kl" and kept is not None:
        assert want[2].any()  # rows with kept top-k ids train


def test_chunked_loss_under_bf16_autocast_recomputes_in_bf16():
    """The backward forms each chunk again under the forward's autocast (bf16 logits), with the
    one-pass loss and gradients."""
    rows, dense, t2d, _ = world(97, 40, "hidden")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loss_and_grads(dense, t2d, "kl", chunk_rows=ROWS)
    seen = []
    g = torch.Generator().manual_seed(7)
    head = nn.Linear(H, 40, bias=False)
    hidden = torch.randn(ROWS, H, generator=g).requires_grad_()

    def score(h, t):
        logits = head(h)
        seen.append(logits.dtype)
        return draft_loss(logits, t, t2d, "kl")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = chunked_rows(score, (hidden,), rows, CHUNK)
    loss.sum().backward()  # outside autocast: the recompute restores it
    assert seen == [torch.bfloat16] * 10  # 5 chunks in the forward, again in the backward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(rows, t2d, "kl", chunk_rows=CHUNK)
    for a, b in zip(got[:1] + got[3:], want[:1] + want[3:], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert torch.equal(got[1], want[1])


def test_chunked_rows_without_gradients_and_with_several_outputs():
    """Under no_grad the chunks run plainly; every per-row output (None ones too) is joined in order."""
    rows, dense, t2d, g = world(97, None, "hidden")
    hidden, extra = torch.randn(ROWS, H, generator=g), torch.randn(ROWS, generator=g)
    head = torch.randn(97, H, generator=g)

    def fn(h, e, t):
        loss, _, valid = draft_loss(h @ head.T + e[:, None], t, None, "kl")
        return loss, None, valid, t.kept_logits.amax(-1)

    with torch.no_grad():
        got = chunked_rows(fn, (hidden, extra), rows, CHUNK)
    want = fn(hidden, extra, dense)
    assert got[1] is None and len(got) == 4
    for a, b in zip(got[:1] + got[2:], want[:1] + want[2:], strict=True):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- no [rows, V] buffer beyond a chunk


class VocabProbe(TorchDispatchMode):
    """What the ops run under it allocate (views and in-place results alias memory that exists):
    the most rows of a tensor whose last dimension is `width`, apart in the forward and the
    backward, and the peak of the bytes alive at once (a tensor's bytes count until the tensor
    is freed, whoever holds it: autograd's saved tensors too)."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.phase, self.most = width, "forward", {"forward": 0, "backward": 0}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, tuple | list) else (out,)
        for t, declared in zip(outputs, func._schema.returns, strict=False):
            if declared.alias_info is not None or not isinstance(t, torch.Tensor):
                continue
            size = t.untyped_storage().nbytes()
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._freed, size)
            if t.dim() >= 1 and t.shape[-1] == self.width:
                self.most[self.phase] = max(self.most[self.phase], t.numel() // self.width)
        return out

    def _freed(self, size: int) -> None:
        self.live -= size


def probed_step(source: str, num_rows: int, chunk: int, kind: str = "kl") -> VocabProbe:
    """chunked_draft_loss forward + backward over `num_rows` rows at the real vocabulary size."""
    rows, _, _, _ = world(REAL_VOCAB, None, source, num_rows=num_rows)
    g = torch.Generator().manual_seed(1)
    head = nn.Linear(H, REAL_VOCAB, bias=False)
    hidden = torch.randn(num_rows, H, generator=g).requires_grad_()
    probe = VocabProbe(REAL_VOCAB)
    with probe:
        loss, _, _ = chunked_draft_loss(head, hidden, rows, None, kind, chunk)
        probe.phase = "backward"
        loss.sum().backward()
    assert head.weight.grad.shape == (REAL_VOCAB, H)  # parameter-sized, not row-sized
    return probe


@pytest.mark.parametrize("kind", ["kl", "ce"])
@pytest.mark.parametrize("source", ["hidden", "topk"])
def test_memory_is_bounded_by_a_chunk_at_the_real_vocabulary_size(source, kind):
    """4-row chunks over 20 or 80 rows: no allocation over the vocabulary has more than 4 rows, in
    the forward or the backward, and the peak of live memory does not grow with the rows (no
    chunk's buffers outlive it: saved for the backward they would add up to [80, V]). One pass
    over the 80 rows allocates 80-row buffers and peaks several times higher."""
    row_bytes = 4 * REAL_VOCAB  # one float32 row over the vocabulary
    few, many = probed_step(source, 20, 4, kind), probed_step(source, 80, 4, kind)
    for probe in (few, many):
        assert probe.most == {"forward": 4, "backward": 4}, probe.most
    assert many.peak <= few.peak + row_bytes, (few.peak / row_bytes, many.peak / row_bytes)
    whole = probed_step(source, 80, 80, kind)
    assert whole.most == {"forward": 80, "backward": 80}
    assert whole.peak > 3 * many.peak, (whole.peak / row_bytes, many.peak / row_bytes)


# ---------------------------------------------------------------- every drafter


def drafter_step(algo, d2t, loss_kind, batch, training=True):
    """One forward + backward of a tiny drafter (same seed: the same anchors / depth rows) ->
    (loss, metrics, {parameter: gradient})."""
    spec = DRAFTERS[algo]
    extra = {"train_lm_head": True} if "train_lm_head" in spec.config_cls.model_fields else {}
    torch.manual_seed(0)
    model = spec.build(spec.config_cls(**spec.tiny, **extra), tiny_verifier(), tiny_weights(), d2t, loss_kind)
    model.train(training)
    torch.manual_seed(1)
    with torch.set_grad_enabled(training):
        loss, metrics = model(batch)
    if not training:
        return loss, metrics, {}
    loss.backward()
    return loss.detach(), metrics, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def topk_batch(batch, k: int = 8):
    """The batch as a top-k store gives it."""
    w = tiny_weights()
    B, T, _ = batch["last_hidden_state"].shape
    ids, logprobs, lse = verifier_topk(batch["last_hidden_state"].flatten(0, 1), w.norm, w.lm_head, 1e-6, k)
    compact = {key: v for key, v in batch.items() if key != "last_hidden_state"}
    return {
        **compact,
        "topk_ids": ids.view(B, T, k),
        "topk_logprobs": logprobs.view(B, T, k),
        "logsumexp": lse.view(B, T),
    }


ALGOS = sorted(DRAFTERS)
CHUNK_ROWS = 7


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize(
    "kind,vocab,store", [("kl", None, "hidden"), ("ce", 100, "hidden"), ("kl", 100, "topk")]
)
def test_every_drafter_trains_the_same_in_chunks(algo, kind, vocab, store, monkeypatch):
    """A 7-row loss chunk (compact targets, several chunks) against the default budget (one pass):
    the same loss, metrics and gradient of every parameter; validation metrics too."""
    freq = torch.rand(256, generator=torch.Generator().manual_seed(3))
    d2t = None if vocab is None else build_draft_vocab(freq, vocab)[0]
    batch = random_batch()
    if store == "topk":
        batch = topk_batch(batch)
    want = drafter_step(algo, d2t, kind, batch)
    want_val = drafter_step(algo, d2t, kind, batch, training=False)
    width = 256 if vocab is None else vocab
    monkeypatch.setattr(targets, "LOSS_CHUNK_BYTES", 4 * width * CHUNK_ROWS)
    watch = VocabProbe(width)
    with watch:  # forward and backward, both counted as "forward" here
        got = drafter_step(algo, d2t, kind, batch)
    assert 0 < watch.most["forward"] <= CHUNK_ROWS, watch.most
    assert int(want[1]["count"].sum()) > 3 * CHUNK_ROWS  # several chunks
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert got[1].keys() == want[1].keys()
    for key in want[1]:
        torch.testing.assert_close(got[1][key], want[1][key], rtol=1e-5, atol=1e-5)
    assert got[2].keys() == want[2].keys() and len(want[2]) > 3
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-6, msg=name)
    got_val = drafter_step(algo, d2t, kind, batch, training=False)
    assert "correct" in want_val[1]
    for key in want_val[1]:
        torch.testing.assert_close(got_val[1][key], want_val[1][key], rtol=1e-5, atol=1e-5)


def test_a_step_in_chunks_forms_no_vocabulary_buffer_beyond_a_chunk_forward_or_backward(monkeypatch):
    """DFlash forward + backward with a 7-row budget: the target table stays compact and no tensor
    over the vocabulary has more rows than a chunk, in either pass."""
    monkeypatch.setattr(targets, "LOSS_CHUNK_BYTES", 4 * 256 * CHUNK_ROWS)
    spec = DRAFTERS["dflash"]
    torch.manual_seed(0)
    model = spec.build(spec.config_cls(**spec.tiny), tiny_verifier(), tiny_weights(), None, "ce").train()
    batch = random_batch()
    table = model.targets(batch)
    assert isinstance(table.targets.table, HiddenKept) and len(table.targets) > CHUNK_ROWS
    watch = VocabProbe(256)
    with watch:
        loss, metrics = model(batch)
        watch.phase = "backward"
        loss.backward()
    assert metrics["count"].sum() > 3 * CHUNK_ROWS
    assert 0 < watch.most["forward"] <= CHUNK_ROWS and 0 < watch.most["backward"] <= CHUNK_ROWS, watch.most


def test_small_tables_keep_formed_logits_and_indexing_forms_none():
    """Within one chunk the table holds its kept logits (formed once, read by every row); beyond
    it the hidden states. Indexing either only picks rows: the logits it gives are the table's."""
    g = torch.Generator().manual_seed(4)
    norm, lm_head = torch.rand(H, generator=g) + 0.5, torch.randn(97, H, generator=g)
    last = torch.randn(POSITIONS, H, generator=g)
    small = verifier_targets(last, norm, lm_head, 1e-6, None)
    big = verifier_targets(last, norm, lm_head, 1e-6, None, dense_rows=POSITIONS - 1)
    assert isinstance(small.table, DenseKept) and isinstance(big.table, HiddenKept)
    index = torch.tensor([3, 3, 0, 10, 7])
    for table in (small, big):
        picked = table[index][1:4]
        assert picked.table is table.table and picked.rows.tolist() == [3, 0, 10]
        torch.testing.assert_close(picked.kept_logits, verifier_logits(last[[3, 0, 10]], norm, lm_head, 1e-6))
        assert torch.equal(picked.argmax, small.argmax[[3, 0, 10]])
    hidden_batch = {
        "last_hidden_state": last[None],
        "loss_mask": torch.ones(1, POSITIONS, dtype=torch.bool),
        "attention_mask": torch.ones(1, POSITIONS, dtype=torch.bool),
    }
    compact = batch_targets(hidden_batch, norm, lm_head, 1e-6, None, dense_rows=2)
    assert isinstance(compact.targets.table, HiddenKept)
