"""EAGLE-3 drafter: TTT mask, loss bookkeeping, training/serving agreement, export, overfit.

The helpers at the top (tiny verifier, features, vLLM loader check, overfit loop) are shared
with tests/test_peagle.py.
"""

from __future__ import annotations

import json
import socket
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from specctl.drafters import DRAFTERS
from specctl.drafters.api import VerifierSpec, VerifierWeights, greedy_propose
from specctl.drafters.eagle3 import SPEC, Config, build, shift_left, ttt_attention
from specctl.drafters.targets import build_draft_vocab, draft_to_target, verifier_logits

VOCAB, HIDDEN, LAYERS, AUX = 256, 64, 4, (1, 2, 3)


# ---------------------------------------------------------------- shared helpers


def tiny_verifier(
    seed: int = 0, hidden: int = HIDDEN, heads: int = 4, kv_heads: int = 2
) -> tuple[LlamaForCausalLM, VerifierSpec, VerifierWeights]:
    """A random 4-layer Llama (vocab 256, H 64, 4 heads / 2 kv heads) and what drafters see of it.

    (vLLM's CPU attention needs head_dim >= 32: pass hidden=128 to serve it there.)
    """
    torch.manual_seed(seed)
    shape = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
    )
    cfg = LlamaConfig(vocab_size=VOCAB, num_hidden_layers=LAYERS, tie_word_embeddings=False, **shape)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random init gives near-uniform next-token distributions; be confident
        model.lm_head.weight.mul_(20.0)
    spec = VerifierSpec(
        name_or_path="tiny-llama",
        architectures=("LlamaForCausalLM",),
        vocab_size=VOCAB,
        num_hidden_layers=LAYERS,
        aux_layer_ids=AUX,
        mask_token_id=VOCAB - 1,
        **shape,
    )
    weights = VerifierWeights(
        embed_tokens=model.model.embed_tokens.weight.detach(),
        lm_head=model.lm_head.weight.detach(),
        norm=model.model.norm.weight.detach(),
    )
    return model, spec, weights


@torch.no_grad()
def verifier_batch(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The training batch of the contract: aux states at AUX and the final hidden BEFORE the norm."""
    captured = {}
    hook = model.model.norm.register_forward_hook(lambda m, i, o: captured.update(pre_norm=i[0]))
    out = model(input_ids=input_ids, output_hidden_states=True)
    hook.remove()
    ones = torch.ones_like(input_ids, dtype=torch.bool)
    return {
        "input_ids": input_ids,
        "aux_hidden_states": torch.stack([out.hidden_states[k] for k in AUX], dim=2),
        "last_hidden_state": captured["pre_norm"],
        "loss_mask": ones.clone() if loss_mask is None else loss_mask,
        "attention_mask": ones.clone() if attention_mask is None else attention_mask,
    }


@torch.no_grad()
def greedy_dataset(model: LlamaForCausalLM, num: int, prompt_len: int, new_tokens: int, seed: int = 1):
    """Conversations the verifier answered greedily: loss_mask on the answer only."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, VOCAB - 1, (num, prompt_len), generator=g)
    ids = prompts
    for _ in range(new_tokens):
        ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, prompt_len:] = True
    return verifier_batch(model, ids, loss_mask)


def pad_tail(batch: dict[str, torch.Tensor], row: int, length: int) -> dict[str, torch.Tensor]:
    """Mark row `row` as padding from `length` on, filling the padded part with junk."""
    batch = {k: v.clone() for k, v in batch.items()}
    batch["attention_mask"][row, length:] = False
    batch["loss_mask"][row, length:] = False
    g = torch.Generator().manual_seed(123)
    tail = batch["input_ids"][row, length:]
    batch["input_ids"][row, length:] = torch.randint(0, VOCAB, tail.shape, generator=g)
    batch["aux_hidden_states"][row, length:] = 100.0
    batch["last_hidden_state"][row, length:] = -50.0
    return batch


def expected_counts(batch: dict[str, torch.Tensor], steps: int) -> torch.Tensor:
    """Brute force: rows t of step s whose predicted token x_{t+2+s} is a real assistant token."""
    B, T = batch["input_ids"].shape
    counts = torch.zeros(steps)
    for s in range(steps):
        for b in range(B):
            for t in range(T - 1):
                j = t + 2 + s
                if j < T and batch["loss_mask"][b, j] and batch["attention_mask"][b, j]:
                    counts[s] += 1
    return counts


def accuracy(drafter, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    drafter.eval()
    with torch.no_grad():
        _, metrics = drafter(batch)
    drafter.train()
    return metrics["correct"] / metrics["count"].clamp(min=1)


def overfit(drafter, batch: dict[str, torch.Tensor], max_steps: int, lr: float, target: float = 0.9):
    """Adam on one repeated batch until validation top-1 > target at every draft position.

    Runs single-threaded: these tensors are tiny, and two OpenMP threads fighting other
    processes for two cores were measured ~10x slower than one.
    """
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        drafter.train()
        acc = accuracy(drafter, batch)
        for step in range(max_steps):
            loss, _ = drafter(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 25 == 24:
                acc = accuracy(drafter, batch)
                if (acc > target).all():
                    return step + 1, acc
        return max_steps, acc
    finally:
        torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_into_vllm(tmp_path, verifier_model, drafter, speculative_config: dict):
    """Instantiate vLLM's own draft model for our export and run its load_weights on our tensors.

    Returns (vLLM model, names of its parameters/buffers still unset after loading). Every
    parameter is filled with a sentinel first, so anything our export misses stays a sentinel,
    and any name vLLM does not know raises inside load_weights.
    """
    pytest.importorskip("vllm")
    from safetensors.torch import load_file, save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    verifier_dir, drafter_dir = tmp_path / "verifier", tmp_path / "drafter"
    verifier_model.save_pretrained(verifier_dir)
    drafter_dir.mkdir()
    config = drafter.export_config().to_json()
    config["speculators_config"]["verifier"]["name_or_path"] = str(verifier_dir)
    (drafter_dir / "config.json").write_text(json.dumps(config))
    save_file(drafter.export_state(), drafter_dir / "model.safetensors")

    engine_args = EngineArgs(
        model=str(verifier_dir),
        speculative_config={"model": str(drafter_dir), **speculative_config},
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=256,
    )
    vllm_config = engine_args.create_engine_config()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
        vllm_model = Eagle3LlamaForCausalLM(vllm_config=vllm_config)
        state = dict(vllm_model.named_parameters())
        if hasattr(vllm_model, "mask_hidden"):
            state["mask_hidden"] = vllm_model.mask_hidden
        sentinel = -12345
        with torch.no_grad():
            for t in state.values():
                t.fill_(float("nan") if t.is_floating_point() else sentinel)
        vllm_model.load_weights(list(load_file(drafter_dir / "model.safetensors").items()))
    unset = {k for k, t in state.items() if torch.isnan(t.float()).any() or (t == sentinel).any()}
    return vllm_model, vllm_config, unset


def check_vllm_weights(vllm_model, ours: dict[str, torch.Tensor]) -> None:
    """vLLM's fused tensors hold exactly our tensors (q|k|v and gate|up stacked)."""
    params = dict(vllm_model.named_parameters())
    for name, value in params.items():
        base = name.removeprefix("model.")
        if base.endswith("qkv_proj.weight"):
            stem = base.removesuffix("qkv_proj.weight")
            expected = torch.cat([ours[f"{stem}{p}_proj.weight"] for p in "qkv"])
        elif base.endswith("gate_up_proj.weight"):
            stem = base.removesuffix("gate_up_proj.weight")
            expected = torch.cat([ours[f"{stem}gate_proj.weight"], ours[f"{stem}up_proj.weight"]])
        elif base == "draft_id_to_target_id":
            expected = ours["d2t"]
        elif base in ours:
            expected = ours[base]
        else:
            continue
        value = value.detach().cpu()
        if name == "lm_head.weight":  # vLLM pads the vocab dim of its LM head (to 64 rows here)
            assert not value[expected.shape[0] :].any(), name
            value = value[: expected.shape[0]]
        assert torch.equal(value, expected), name


def embedded_acceptance(drafter, data: dict[str, torch.Tensor], prompt_len: int, end: int, k: int):
    """Greedy speculative decoding of the verifier's own greedy text with propose(): per-position
    accepted counts and number of drafts, counted the way vLLM's spec_decode metrics count them.

    data must run a few tokens past `end` (vLLM verifies drafts beyond max_tokens too).
    """
    ids, aux = data["input_ids"], data["aux_hidden_states"]
    accepted, drafts = [0] * k, 0
    for b in range(ids.shape[0]):
        n = prompt_len + 1  # the prefill already produced one token
        while n < end:
            proposal = greedy_propose(drafter, ids[b, :n], aux[b, : n - 1], k)
            a = 0
            while a < k and proposal[a] == ids[b, n + a]:
                accepted[a] += 1
                a += 1
            drafts += 1
            n += a + 1
    return accepted, drafts


VLLM_SCRIPT = """
import json, os, sys
# the engine in this process: one vLLM start instead of three (EngineCore and Worker are spawned
# on CPU, 14 s of imports each on 2 cores); what this checks is the drafter's numerics, not vLLM's
# process layout (the benches and test_kill.py run that)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
args = json.loads(sys.argv[1])
llm = LLM(model=args["verifier"], speculative_config=args["speculative_config"], skip_tokenizer_init=True,
          enforce_eager=True, dtype="float32", max_model_len=128, disable_log_stats=False, max_num_seqs=1)
params = SamplingParams(max_tokens=args["max_tokens"], temperature=0.0, detokenize=False, ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params)
metrics = {m.name: getattr(m, "values", None) or getattr(m, "value", None)
           for m in llm.get_metrics() if "spec_decode" in m.name}
print("RESULT " + json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs], "metrics": metrics}))
"""


def vllm_acceptance(tmp_path, verifier_model, drafter, prompts: list[list[int]], max_tokens: int, spec: dict):
    """Serve the exported drafter with vLLM (offline LLM, engine inside a child process) -> outputs,
    metrics."""
    import os
    import signal
    import subprocess
    import sys

    from safetensors.torch import save_file

    verifier_dir, drafter_dir = tmp_path / "verifier", tmp_path / "drafter"
    verifier_model.save_pretrained(verifier_dir)
    drafter_dir.mkdir()
    config = drafter.export_config().to_json()
    config["speculators_config"]["verifier"]["name_or_path"] = str(verifier_dir)
    (drafter_dir / "config.json").write_text(json.dumps(config))
    save_file(drafter.export_state(), drafter_dir / "model.safetensors")
    args = {
        "verifier": str(verifier_dir),
        "speculative_config": {"model": str(drafter_dir), **spec},
        "prompts": prompts,
        "max_tokens": max_tokens,
    }
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", VLLM_SCRIPT, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # vLLM spawns EngineCore/Worker children: stop the whole group
    )
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, out[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def verifier():
    return tiny_verifier()


@pytest.fixture(scope="module")
def batch(verifier):
    model, _, _ = verifier
    ids = torch.randint(0, VOCAB - 1, (3, 24), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, 6:] = True
    loss_mask[0, 14:17] = False  # a user turn in the middle of the first conversation
    return pad_tail(verifier_batch(model, ids, loss_mask), row=2, length=15)


# ---------------------------------------------------------------- mask


def ttt_attention_mask(num_rows: int, step: int) -> torch.Tensor:
    """The former TTT layout, the reference: [R, (step+1)*R] bool over the keys of steps
    0..step, step-major (key k*R + j = row j of step k)."""
    rows = torch.arange(num_rows)
    causal = rows[None, :] <= rows[:, None]  # [R, R] step-0 context
    own = torch.eye(num_rows, dtype=torch.bool)  # [R, R] same row, later steps
    return torch.cat([causal] + [own] * step, dim=1)


@pytest.mark.parametrize("rows", [1, 2, 7])
@pytest.mark.parametrize("step", [0, 1, 3])
def test_ttt_mask_matches_brute_force(rows, step):
    mask = ttt_attention_mask(rows, step)
    assert mask.shape == (rows, (step + 1) * rows)
    for t in range(rows):
        for k in range(step + 1):
            for j in range(rows):
                # step 0 rows are the cached context (causal); later steps only the query's own chain
                expected = j <= t if k == 0 else j == t
                assert bool(mask[t, k * rows + j]) == expected, (t, k, j)


@pytest.mark.parametrize(
    ("rows", "step", "heads", "kv_heads"), [(1, 0, 4, 2), (7, 0, 2, 2), (7, 3, 4, 2), (5, 1, 4, 1)]
)
def test_ttt_attention_equals_dense_masked_attention(rows, step, heads, kv_heads):
    """Causal context + each row's own steps = one softmax over every step behind the dense
    reference mask; values and gradients. Also the propose form (newest row, all context)."""
    g = torch.Generator().manual_seed(rows + step)
    B, hd = 2, 16
    q = torch.randn(B, heads, rows, hd, generator=g, requires_grad=True)
    ks = [torch.randn(B, kv_heads, rows, hd, generator=g, requires_grad=True) for _ in range(step + 1)]
    vs = [torch.randn(B, kv_heads, rows, hd, generator=g, requires_grad=True) for _ in range(step + 1)]
    own = (torch.stack(ks[1:], 3), torch.stack(vs[1:], 3)) if step else None  # [B, kvh, R, s, hd]
    got = ttt_attention(q, (ks[0], vs[0]), own, causal=True)
    mask = ttt_attention_mask(rows, step)[None, None]
    want = F.scaled_dot_product_attention(
        q, torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=mask, enable_gqa=True
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    weights = torch.randn(got.shape, generator=g)
    inputs = [q, *ks, *vs]
    got_grads = torch.autograd.grad((got * weights).sum(), inputs)
    want_grads = torch.autograd.grad((want * weights).sum(), inputs)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # propose: one query (the newest row) after every context row, plus its own drafted steps
    last = (own[0][:, :, -1:], own[1][:, :, -1:]) if step else None
    got = ttt_attention(q[:, :, -1:], (ks[0], vs[0]), last, causal=False)
    keys = [ks[0]] + [k[:, :, -1:] for k in ks[1:]]
    values = [vs[0]] + [v[:, :, -1:] for v in vs[1:]]
    want = F.scaled_dot_product_attention(
        q[:, :, -1:], torch.cat(keys, 2), torch.cat(values, 2), enable_gqa=True
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def reference_ttt_outputs(drafter, input_ids, aux_hidden_states):
    """Eagle3Drafter.ttt_outputs as it was: every step's queries over the K/V of all cached
    steps behind the dense [R, (s+1)R] mask. Slow; the reference."""

    def attend(cache, mask, i, attn, x, cos, sin):
        q = attn.project_q(x, cos, sin)
        cache[i].append(attn.project_kv(x, cos, sin))
        k = torch.cat([kv[0] for kv in cache[i]], dim=2)
        v = torch.cat([kv[1] for kv in cache[i]], dim=2)
        return attn.attend(q, k, v, mask[:, None])

    B, T = input_ids.shape
    R = T - 1
    hidden = drafter.combine(aux_hidden_states[:, :R])
    positions = torch.arange(R).expand(B, R)
    cache = [[] for _ in drafter.layers]
    outs = []
    for s in range(drafter.config.ttt_steps):
        tokens = shift_left(input_ids, 1 + s)[:, :R]
        mask = ttt_attention_mask(R, s)[None]
        out, hidden = drafter.run_layers(tokens, hidden, positions + s, partial(attend, cache, mask))
        outs.append(out)
    return outs


@pytest.mark.parametrize(
    "config",
    [
        dict(num_layers=2, ttt_steps=3),
        dict(num_layers=1, ttt_steps=1),
        dict(num_layers=2, ttt_steps=4, norm_before_residual=True, norm_output=True, ttt_step_loss_decay=0.7),
    ],
)
def test_training_pass_matches_dense_reference(verifier, batch, config, monkeypatch):
    """Loss, per-step losses and every gradient equal the former dense-mask formulation's
    (padded row included)."""
    _, spec, weights = verifier
    torch.manual_seed(0)
    drafter = build(Config(**config), spec, weights, None, "kl")
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    params = [p for p in drafter.parameters() if p.requires_grad]
    loss, metrics = drafter(batch)
    grads = torch.autograd.grad(loss, params)
    monkeypatch.setattr(drafter, "ttt_outputs", partial(reference_ttt_outputs, drafter))
    ref_loss, ref_metrics = drafter(batch)
    ref_grads = torch.autograd.grad(ref_loss, params)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics["step_loss"], ref_metrics["step_loss"], rtol=1e-5, atol=1e-5)
    names = [n for n, p in drafter.named_parameters() if p.requires_grad]
    for name, g, r in zip(names, grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=name)


# ---------------------------------------------------------------- training forward


def test_forward_backward_counts_and_padding(verifier, batch):
    _, spec, weights = verifier
    drafter = build(Config(num_layers=2, ttt_steps=3), spec, weights, None, "kl")
    loss, metrics = drafter(batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert "correct" not in metrics  # a KL training step forms no full-vocabulary argmax
    assert torch.equal(metrics["count"], expected_counts(batch, 3))
    with torch.no_grad():
        _, scored = drafter.eval()(batch)
    drafter.train()
    assert scored["correct"].shape == scored["count"].shape == (3,)
    assert torch.equal(scored["count"], metrics["count"]) and (scored["correct"] <= scored["count"]).all()
    loss.backward()
    trainable = {n for n, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    expected = {"fc.weight", "lm_head.weight", "layers.1.mlp.down_proj.weight", "layers.0.hidden_norm.weight"}
    assert expected <= trainable
    # the verifier's embeddings / head are frozen buffers, never trained nor exported
    assert "embed_tokens" not in dict(drafter.named_parameters())
    assert not any("embed" in k or "verifier" in k for k in drafter.export_state())

    # nothing in the padded tail of row 2 can change the loss
    junk = pad_tail(batch, row=2, length=15)
    junk["aux_hidden_states"][2, 15:] = -7.0
    junk["input_ids"][2, 15:] = 3
    with torch.no_grad():
        a, _ = drafter(batch)
        b, _ = drafter(junk)
    torch.testing.assert_close(a, b)


def test_training_step_equals_serving_step(verifier, batch):
    """TTT step s at row t computes what propose() computes drafting token s+1 after anchor t."""
    _, spec, weights = verifier
    torch.manual_seed(3)
    drafter = build(
        Config(num_layers=2, ttt_steps=4, norm_before_residual=True, norm_before_fc=True, fc_norm=True),
        spec,
        weights,
        None,
        "kl",
    ).eval()
    ids, aux = batch["input_ids"][0], batch["aux_hidden_states"][0]
    for t in (0, 5, 12):
        drafts = greedy_propose(drafter, ids[: t + 2], aux[: t + 1], 4)
        assert drafts.shape == (4,) and drafts.dtype == torch.long
        # teacher-force the drafts themselves: x_{t+1+s} := draft s for s >= 1
        forced = ids.clone()
        forced[t + 2 : t + 5] = drafts[:3]
        with torch.no_grad():
            outs = drafter.ttt_outputs(forced[None], aux[None])
        trained = torch.stack([drafter.lm_head(out[0, t]).argmax() for out in outs])
        assert torch.equal(trained, drafts), (t, trained, drafts)


def test_step_loss_decay_weights_steps(verifier, batch):
    _, spec, weights = verifier
    torch.manual_seed(0)
    flat = build(Config(ttt_steps=3), spec, weights, None, "kl")
    decayed = build(Config(ttt_steps=3, ttt_step_loss_decay=0.5), spec, weights, None, "kl")
    decayed.load_state_dict(flat.state_dict())
    with torch.no_grad():
        loss_flat, m = flat(batch)
        loss_decayed, _ = decayed(batch)
    torch.testing.assert_close(loss_flat, m["step_loss"].sum())
    torch.testing.assert_close(loss_decayed, (m["step_loss"] * torch.tensor([1.0, 0.5, 0.25])).sum())


@pytest.mark.parametrize("loss_kind", ["kl", "ce"])
def test_reduced_vocab_and_loss_kinds(verifier, batch, loss_kind):
    model, spec, weights = verifier
    freq = torch.bincount(batch["input_ids"].flatten(), minlength=VOCAB).float()
    # make sure some verifier argmaxes fall outside the draft vocab
    d2t, t2d = build_draft_vocab(freq, 40)
    drafter = build(Config(ttt_steps=2), spec, weights, d2t, loss_kind)
    assert drafter.lm_head.weight.shape == (40, HIDDEN)
    kept = t2d.nonzero()[:, 0]
    torch.testing.assert_close(drafter.lm_head.weight, weights.lm_head[kept])
    loss, metrics = drafter(batch)
    loss.backward()
    assert torch.isfinite(loss) and drafter.fc.weight.grad is not None

    # brute-force accuracy: mapped draft argmax == verifier argmax, over counted rows
    with torch.no_grad():
        _, metrics = drafter.eval()(batch)
        outs = drafter.ttt_outputs(batch["input_ids"], batch["aux_hidden_states"])
        target = verifier_logits(batch["last_hidden_state"], weights.norm, weights.lm_head, spec.rms_norm_eps)
    B, T = batch["input_ids"].shape
    for s, out in enumerate(outs):
        correct = 0
        for b in range(B):
            for t in range(T - 2 - s):
                j = t + 2 + s
                if batch["loss_mask"][b, j] and batch["attention_mask"][b, j]:
                    draft = draft_to_target(drafter.lm_head(out[b, t]).argmax(), d2t)
                    correct += int(draft == target[b, t + 1 + s].argmax())
        assert metrics["correct"][s] == correct
    drafts = greedy_propose(drafter, batch["input_ids"][0, :9], batch["aux_hidden_states"][0, :8], 3)
    assert t2d[drafts].all()
    assert torch.equal(drafter.export_state()["d2t"], d2t)
    assert drafter.export_config().to_json()["draft_vocab_size"] == 40


def test_full_size_d2t_is_the_full_vocabulary(verifier):
    _, spec, weights = verifier
    drafter = build(Config(), spec, weights, torch.zeros(VOCAB, dtype=torch.long), "kl")
    assert "d2t" not in drafter.export_state()  # vLLM has no draft_id_to_target_id at full size
    with pytest.raises(ValueError):
        build(Config(), spec, weights, torch.tensor([5, 5, 0]), "kl")  # targets 5, 6, 2: not increasing


# ---------------------------------------------------------------- export


def from_export(cfg: dict, tensors: dict, weights):
    """The drafter a config.json object and its tensors describe (the path every loader takes)."""
    return SPEC.from_export(SPEC.format_cls.from_json(cfg), tensors, weights)


def test_export_config_is_speculators_format(verifier):
    _, spec, weights = verifier
    drafter = build(Config(num_speculative_tokens=4), spec, weights, None, "kl")
    cfg = drafter.export_config().to_json()
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["architectures"] == ["Eagle3DraftModel"]
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["vocab_size"] == VOCAB
    assert layer["num_hidden_layers"] == 1 and layer["head_dim"] == 16 and layer["num_key_value_heads"] == 2
    assert cfg["draft_vocab_size"] == VOCAB and cfg["target_hidden_size"] is None
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    sc = cfg["speculators_config"]
    assert sc["proposal_methods"][0]["speculative_tokens"] == 4
    assert sc["verifier"] == {"name_or_path": "tiny-llama", "architectures": ["LlamaForCausalLM"]}
    assert {"norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"} <= cfg.keys()
    assert DRAFTERS["eagle3"].speculators_model_type == "eagle3"


@pytest.mark.parametrize("reduced", [False, True])
def test_export_round_trip(verifier, batch, reduced):
    _, spec, weights = verifier
    d2t = build_draft_vocab(torch.arange(VOCAB).float(), 100)[0] if reduced else None
    torch.manual_seed(5)
    config = Config(num_layers=2, ttt_steps=2, norm_before_fc=True, norm_output=True)
    drafter = build(config, spec, weights, d2t, "ce")
    with torch.no_grad():  # make every exported tensor differ from its init
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    cfg = drafter.export_config().to_json()
    rebuilt = from_export(cfg, drafter.export_state(), weights)
    assert rebuilt.config == config and rebuilt.loss_kind == "ce"
    with torch.no_grad():
        a, ma = drafter(batch)
        b, mb = rebuilt(batch)
    assert torch.equal(a, b) and torch.equal(ma["correct"], mb["correct"])
    ids, aux = batch["input_ids"][1], batch["aux_hidden_states"][1]
    assert torch.equal(
        greedy_propose(drafter, ids[:11], aux[:10], 3), greedy_propose(rebuilt, ids[:11], aux[:10], 3)
    )
    with pytest.raises(ValueError, match="missing"):
        from_export(cfg, {k: v for k, v in drafter.export_state().items() if k != "fc.weight"}, weights)


@pytest.mark.vllm
@pytest.mark.parametrize("reduced", [False, True])
def test_export_loads_in_vllm(tmp_path, verifier, reduced):
    """vLLM's Eagle3LlamaForCausalLM accepts every exported name and fills every used weight."""
    model, spec, weights = verifier
    d2t = build_draft_vocab(torch.arange(VOCAB).float(), 100)[0] if reduced else None
    drafter = build(Config(num_layers=2, num_speculative_tokens=3), spec, weights, d2t, "kl")
    vllm_model, vllm_config, unset = load_into_vllm(
        tmp_path, model, drafter, {"method": "eagle3", "num_speculative_tokens": 3}
    )
    # embed_tokens is shared from the verifier at serve time; hidden_norm exists in every vLLM
    # layer but only layer 0 uses it
    assert unset == {"model.embed_tokens.weight", "model.layers.1.hidden_norm.weight"}
    check_vllm_weights(vllm_model, drafter.export_state())
    hf = vllm_config.speculative_config.draft_model_config.hf_config
    assert hf.eagle_aux_hidden_state_layer_ids == list(AUX)
    assert hf.draft_vocab_size == (100 if reduced else VOCAB)
    assert hf.rope_parameters["rope_theta"] == spec.rope_theta


# ---------------------------------------------------------------- learning


def test_overfits_a_real_verifier(verifier):
    model, spec, weights = verifier
    data = greedy_dataset(model, num=8, prompt_len=4, new_tokens=28)
    data = pad_tail(data, row=7, length=24)
    torch.manual_seed(0)
    drafter = build(Config(ttt_steps=3), spec, weights, None, "kl")
    steps, acc = overfit(drafter, data, max_steps=500, lr=1e-2)
    assert (acc > 0.9).all(), (steps, acc)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_what_propose_drafts(tmp_path):
    """Trained, exported, served by vLLM: its acceptance counts equal those of our propose().

    A drafter whose training or propose() disagreed with vLLM's EAGLE-3 proposer (positions,
    fed-back hidden, layer-0 norms, d2t) would still load, but acceptance would collapse there.
    """
    pytest.importorskip("vllm")
    model, spec, weights = tiny_verifier(hidden=128)  # vLLM's CPU attention needs head_dim >= 32
    data = greedy_dataset(model, num=8, prompt_len=4, new_tokens=28 + 6, seed=7)
    train = {k: v[:, : 4 + 28] for k, v in data.items()}
    torch.manual_seed(0)
    drafter = build(Config(ttt_steps=4, num_speculative_tokens=4), spec, weights, None, "kl")
    overfit(drafter, train, max_steps=600, lr=1e-2)
    drafter.eval()
    accepted, drafts = embedded_acceptance(drafter, data, prompt_len=4, end=4 + 28, k=4)
    assert sum(accepted) / drafts > 2.0  # a drafter worth checking: tau > 3 here
    served = vllm_acceptance(
        tmp_path,
        model,
        drafter,
        data["input_ids"][:, :4].tolist(),
        28,
        {"method": "eagle3", "num_speculative_tokens": 4},
    )
    assert served["outputs"] == data["input_ids"][:, 4 : 4 + 28].tolist()  # lossless
    m = served["metrics"]
    assert abs(m["vllm:spec_decode_num_drafts"] - drafts) <= 2
    for ours, theirs in zip(accepted, m["vllm:spec_decode_num_accepted_tokens_per_pos"], strict=True):
        assert abs(ours - theirs) <= 3, (accepted, m)
