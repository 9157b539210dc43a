"""Tests for mecheval: tasks, model, training loop and command line. Quick on 2 CPU cores."""
import bisect
import collections
import contextlib
import ast
import copy
import dataclasses
import io
import json
import math
import os
import random
import re
import subprocess
import sys
import time
import unittest.mock

import pytest
import torch

import mecheval as m

HERE = os.path.dirname(os.path.abspath(__file__))


def small_ar(**kw):
    base = dict(task="ar", n_pairs=5, n_keys=20, n_values=30, n_train=200, n_eval=64)
    return m.Config(**{**base, **kw})


def small_atr(**kw):
    return m.Config(**{**dict(task="atr", n_train=300, n_eval=100), **kw})


# ---------------------------------------------------------------------------------------------- AR

def check_ar_split(split, cfg):
    P, K, V = cfg.n_pairs, cfg.n_keys, cfg.n_values
    ids, N = split.input_ids, len(split)
    assert ids.shape == (N, 2 * P + 5) and (split.lengths == 2 * P + 5).all()
    assert (ids[:, 0] == m.BOS).all() and (ids[:, 2 * P + 1] == m.EOS).all() and (ids[:, -1] == m.EOS).all()
    keys, vals = ids[:, 1:2 * P + 1:2], ids[:, 2:2 * P + 2:2]
    assert ((keys >= 3) & (keys < 3 + K)).all() and ((vals >= 3 + K) & (vals < 3 + K + V)).all()
    for row in range(N):  # distinct keys and distinct values within a document
        assert len(set(keys[row].tolist())) == P and len(set(vals[row].tolist())) == P
    rows, pos = torch.arange(N), split.pos
    i = (pos["key"] - 1) // 2                                     # the queried pair
    assert (pos["key"] == 1 + 2 * i).all() and (pos["value"] == 2 + 2 * i).all()
    assert ((pos["next_key"] == 3 + 2 * i) | ((pos["next_key"] == -1) & (i == P - 1))).all()
    assert (pos["divider"] == 2 * P + 1).all() and (pos["query"] == 2 * P + 2).all()
    assert (pos["answer"] == 2 * P + 3).all()
    query, answer = ids[rows, pos["query"]], ids[rows, pos["answer"]]
    assert (ids[rows, pos["key"]] == query).all(), "the query is the key in context"
    assert (ids[rows, pos["value"]] == answer).all(), "the answer is that key's value"
    assert ((keys == query[:, None]).sum(1) == 1).all(), "the query occurs exactly once in context"
    assert torch.equal(split.answers, vals[rows, i]) and (pos["answer"] == pos["query"] + 1).all(), \
        "the trained prediction: the queried pair's value, the token after the query"


def test_ar_layout_and_positions():
    cfg = small_ar()
    task = m.make_task(cfg)
    assert task.vocab_size == 3 + 20 + 30
    check_ar_split(task.train, cfg)
    check_ar_split(task.eval, cfg)
    i = (task.train.pos["key"] - 1) // 2
    assert set(i.tolist()) == set(range(cfg.n_pairs)), "every pair gets queried"


def test_ar_paper_defaults():
    cfg = m.Config(n_train=64, n_eval=32)
    task = m.make_task(cfg)
    assert task.vocab_size == 8195 and task.train.input_ids.shape == (64, 37)
    assert cfg.n_pairs == 16 and cfg.steps == 50_016 and cfg.batch_size == 32
    assert m.Config().n_train == 100_032 and m.Config().n_eval == 320
    check_ar_split(task.train, cfg)


def test_ar_dense_vocab_uses_exact_sampler():
    cfg = small_ar(n_pairs=8, n_keys=8, n_values=9)  # every key in every document
    check_ar_split(m.make_task(cfg).train, cfg)


# ---------------------------------------------------------------------------------------------- ATR

class Node:
    """The test's own derivation tree: a nonterminal with its children and its head leaf."""

    def __init__(self, children, head):
        self.children, self.head = children, head


def replay_tree(grammar, r):
    """Rebuild the derivation of one sentence with the test's own tree code, drawing from r in the
    documented order (start symbol, then per expansion: the rule, the body left to right, the head)."""
    def pick(cum):  # inverse-CDF draw of one index from cumulative weights
        return min(bisect.bisect(cum, r.random() * cum[-1]), len(cum) - 1)

    def expand(x):
        rule = grammar.rules[x][pick(grammar.rule_cum[x])]
        children = [("leaf", s) if s >= 0 else expand(-s - 1) for s in rule]
        return Node(children, ("leaf", pick(grammar.head_cum[x])))
    return expand(r.randrange(len(grammar.rules)))


def tree_yield_and_parents(root):
    """Walk the tree: leaves in order, and for each leaf the index of its parent (-1 for the root head)."""
    leaves, parent_of = [], {}

    def walk(node):  # returns the index of node's head leaf
        kids = []
        for ch in node.children:
            if isinstance(ch, Node):
                kids.append(walk(ch))
            else:
                leaves.append(ch[1])
                kids.append(len(leaves) - 1)
        leaves.append(node.head[1])
        for k in kids:
            parent_of[k] = len(leaves) - 1
        return len(leaves) - 1

    walk(root)
    return leaves, [parent_of.get(i, -1) for i in range(len(leaves))]


def atr_grammar(cfg):
    max_body, n_terminals = m.ATR_SETTINGS[cfg.atr_setting]
    return m.Grammar(m.np.random.default_rng([cfg.seed, 2]), n_terminals, max_body)


@pytest.mark.parametrize("setting, query", [("easy", "parent"), ("medium", "parent"), ("8192", "parent"),
                                            ("easy", "inner")])
def test_atr_against_independent_trees(setting, query):
    """Each document rebuilt from its own stream; inner queries: parent queries whose parent is not the root."""
    cfg = small_atr(atr_setting=setting, atr_query=query, n_train=150, n_eval=20)
    inner = query == "inner"
    task = m.make_task(cfg)
    grammar = atr_grammar(cfg)
    n_terminals = m.ATR_SETTINGS[setting][1]
    assert task.vocab_size == 3 + n_terminals
    split, ids, pos = task.train, task.train.input_ids, task.train.pos
    for n in range(len(split)):
        r = random.Random(f"{cfg.seed}/train/{n}")
        while True:  # replay the draws, rejecting as documented, until the accepted sentence
            leaves, parents = tree_yield_and_parents(replay_tree(grammar, r))
            last = {t: i for i, t in enumerate(leaves)}
            if 3 <= len(leaves) <= m.MAX_LEN - 5 and any(parents[i] >= 0 and (not inner or parents[parents[i]] >= 0)
                                                         for i in last.values()):
                break
        L = len(leaves)
        assert ids[n, 1:L + 1].tolist() == [t + 3 for t in leaves], "the yield matches the rebuilt tree"
        assert ids[n, 0] == m.BOS and ids[n, L + 1] == m.EOS and ids[n, L + 4] == m.EOS
        assert split.lengths[n] == L + 5 and (ids[n, L + 5:] == m.PAD).all()
        c, p = int(pos["key"][n]) - 1, int(pos["value"][n]) - 1
        assert parents[c] == p, "value is the parent of key in the rebuilt tree"
        assert p > c, "the parent lies to the right of the child"
        assert not inner or (parents[p] >= 0 and p < L - 1), "an inner query's parent is not the root, the last token"
        assert last[leaves[c]] == c, "the queried child is the rightmost of its type"
        assert ids[n, pos["query"][n]] == leaves[c] + 3 and ids[n, pos["answer"][n]] == leaves[p] + 3
        assert pos["next_key"][n] == pos["key"][n] + 1 and pos["divider"][n] == L + 1
        assert pos["query"][n] == L + 2 and pos["answer"][n] == L + 3
        assert split.answers[n] == leaves[p] + 3, "the trained answer is the parent"
    lengths = split.lengths - 5
    assert lengths.min() >= 3 and lengths.max() <= m.MAX_LEN - 5


def test_atr_sibling_queries_against_independent_trees():
    """App. D.4: the answer is the child's rightmost sibling (the rightmost leaf with its parent, the child itself if
    none lies right of it), and both are the rightmost of their types; value is the answer's position, -1 for itself."""
    cfg = small_atr(atr_query="sibling", n_train=150, n_eval=20)
    task, grammar = m.make_task(cfg), atr_grammar(cfg)
    split = task.train
    assert task.query == "sibling" and m.make_task(small_atr(n_train=40)).query == "parent"  # what the verdict reads
    ids, pos, selves = split.input_ids, split.pos, 0
    for n in range(len(split)):
        r = random.Random(f"{cfg.seed}/train/{n}")
        while True:  # the root is its own sibling answer, so every sentence of 3 tokens or more has a query
            leaves, parents = tree_yield_and_parents(replay_tree(grammar, r))
            if 3 <= len(leaves) <= m.MAX_LEN - 5:
                break
        last = {t: i for i, t in enumerate(leaves)}
        c = int(pos["key"][n]) - 1
        a = max(j for j, q in enumerate(parents) if q == parents[c])
        assert last[leaves[c]] == c and last[leaves[a]] == a, "child and answer are the rightmost of their types"
        assert split.answers[n] == leaves[a] + 3 and ids[n, pos["query"][n]] == leaves[c] + 3
        assert pos["value"][n] == (a + 1 if a != c else -1) and pos["next_key"][n] == c + 2
        selves += a == c
    assert 0 < selves < len(split), "some children answer themselves, some have a sibling to their right"
    with pytest.raises(m.ConfigError, match="corrupt=value needs a value in every document"):
        small_atr(atr_query="sibling", corrupt="value")


def test_atr_tree_statistics_easy():
    task = m.make_task(small_atr(n_train=3000, n_eval=10))
    dist = (task.train.pos["value"] - task.train.pos["key"]).float().mean().item()
    assert 1.5 < dist < 4.0, f"mean child->parent distance {dist} far from the paper's ~2.4"
    assert 5 < (task.train.lengths - 5).float().mean() < 25


def test_a_rejection_loop_that_never_accepts_ends_in_one_sentence(monkeypatch):
    grammar = atr_grammar(small_atr())
    monkeypatch.setattr(grammar, "sample", lambda rng, max_tokens: None)  # every sentence too long
    with pytest.raises(m.ConfigError, match="100,000 sentences in a row had no query allowed"):
        m.make_atr_split(grammar, 1, "s")


def test_atr_generalisation_split():
    task = m.make_task(small_atr(atr_split="gen", n_train=400, n_eval=100))
    held = task.heldout
    assert 0.1 < held.float().mean() < 0.3

    def pairs(split):
        rows = torch.arange(len(split))
        parent = split.input_ids[rows, split.pos["value"]] - 3
        child = split.input_ids[rows, split.pos["key"]] - 3
        return held[parent, child]

    assert not pairs(task.train).any(), "training queries never use a held-out pair"
    assert not pairs(task.eval).any(), "dev queries use allowed pairs only"
    assert pairs(task.test).all(), "test queries use held-out pairs only"
    assert len(task.test) == len(task.eval) == 100
    iid = m.make_task(small_atr(n_train=400, n_eval=100))
    assert iid.test is None and not torch.equal(iid.train.input_ids[:50], task.train.input_ids[:50])


def test_atr_documents_over_the_longest_allowed_are_redrawn(monkeypatch):
    cfg = small_atr(atr_setting="medium", n_train=200, n_eval=200)
    free = m.make_task(cfg)
    assert int(free.train.lengths.max()) > 24, "the grammar does produce longer documents"
    monkeypatch.setattr(m, "MAX_LEN", 24)
    capped = m.make_task(cfg)
    for split in (capped.train, capped.eval):
        assert int(split.lengths.max()) <= 24
        assert ((split.input_ids != m.PAD).sum(1) == split.lengths).all()
    short = free.train.lengths <= 24  # drawn within the cap: mostly the same document (each has its own stream)
    same = (capped.train.input_ids[short, :24] == free.train.input_ids[short, :24]).all(1)
    assert same.float().mean() > 0.9 and not (capped.train.input_ids[~short] == free.train.input_ids[~short, :24]).all(1).any()


def test_generalisation_split_trains_once_and_reports_dev_and_test(tmp_path, capsys):
    base = small_atr(atr_split="gen", d_model=16, steps=40, eval_every=20, target_acc=0, out_dir=str(tmp_path))
    summary = m.sweep(base, widths=(16,), lrs=(3e-3,), log=lambda s: None)
    res = json.loads((tmp_path / summary["rows"][0]["run"] / "results.json").read_text())
    _, model = m.load_run(str(tmp_path / summary["rows"][0]["run"]))
    task = m.make_task(base, train=False)
    assert res["test_acc"] == m.evaluate(model, task.test)["acc"] and res["final_acc"] == m.evaluate(model, task.eval)["acc"]
    for key, split in (("mechanism", task.eval), ("mechanism_test", task.test)):
        assert res[key]["grid"] == m.mechanism(model, task, "key", 0, split)["grid"]
    assert res["mechanism"]["grid"] != res["mechanism_test"]["grid"]
    row = summary["rows"][0]
    assert row["test_acc"] == 100 * res["test_acc"]
    assert row["test_attribution"]["value"] == next(g["attribution"] for g in res["mechanism_test"]["grid"]
                                                    if (g["site"], g["layer"], g["position"]) == ("block_input", 1, "value"))
    assert "generalisation split: dev -> test" in (tmp_path / "summary.md").read_text()
    run = str(tmp_path / summary["rows"][0]["run"])
    assert m.main(["--load", run]) == 0
    assert f"test split (held-out pairs): acc {res['test_acc']:.4f}" in capsys.readouterr().out


# ------------------------------------------------------------------------------------- determinism

def test_same_seed_same_data_other_seed_other_data():
    for make in (small_ar, small_atr):
        a, b, c = m.make_task(make(seed=3)), m.make_task(make(seed=3)), m.make_task(make(seed=4))
        assert torch.equal(a.train.input_ids, b.train.input_ids) and torch.equal(a.eval.answers, b.eval.answers)
        assert not torch.equal(a.eval.input_ids[:, :5], c.eval.input_ids[:, :5])
    for make in (small_ar, small_atr):
        big, small = m.make_task(make(seed=3, n_train=500)), m.make_task(make(seed=3))
        assert torch.equal(big.eval.input_ids, small.eval.input_ids), "eval data does not depend on n_train"


def test_same_seed_same_first_losses(tmp_path):
    def losses(seed):
        cfg = small_ar(seed=seed, steps=3, eval_every=1, target_acc=0, out_dir=str(tmp_path),
                       run_name=f"s{seed}_{random.random()}")
        return [h["loss"] for h in m.train(cfg, log=lambda s: None)["history"]]
    first = losses(0)
    assert first == losses(0)
    assert first != losses(1)


# ----------------------------------------------------------------------------------------------- model

def sdpa_reference(q, k, v, is_causal=True):
    """Attention's formula, o = softmax(q kᵀ / √d + mask) v with mask[t, s] = -1e4 for s > t, written out: the
    reference of F.scaled_dot_product_attention (patched in by with_reference_attention)."""
    assert is_causal
    L = q.shape[-2]
    mask = torch.triu(torch.full((L, L), -10000.0, device=q.device), diagonal=1)
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask, dim=-1) @ v


def with_reference_attention():
    return unittest.mock.patch.object(m.F, "scaled_dot_product_attention", sdpa_reference)


def test_attention_fast_equals_reference_outputs_and_grads():
    torch.manual_seed(0)
    att = m.Attention(m.Config(d_model=16), 0)
    for T in (1, 7, 37):
        x = torch.randn(3, T, 16, requires_grad=True)
        gy = torch.randn(3, T, 16)
        outs = []
        for ref in (False, True):
            x.grad = None
            att.zero_grad()
            with with_reference_attention() if ref else contextlib.nullcontext():
                y = att(x)
            y.backward(gy)
            outs.append((y.detach(), x.grad.clone(), [p.grad.clone() for p in att.parameters()]))
        (y0, gx0, gp0), (y1, gx1, gp1) = outs
        torch.testing.assert_close(y0, y1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx0, gx1, rtol=1e-5, atol=1e-6)
        for a, b in zip(gp0, gp1):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_model_is_causal_and_shapes():
    cfg = small_ar(d_model=32)
    model = m.build_model(cfg, 53)
    ids = torch.randint(3, 53, (2, 15))
    logits = model(ids)
    assert logits.shape == (2, 15, 53)
    for t in (0, 6, 14):
        ids2 = ids.clone()
        ids2[:, t] = (ids2[:, t] + 1 - 3) % 50 + 3
        logits2 = model(ids2)
        assert torch.equal(logits[:, :t], logits2[:, :t]), f"changing token {t} changed earlier logits"
        assert not torch.allclose(logits[:, t], logits2[:, t])


def test_parameter_counts_and_init():
    cfg = m.Config(d_model=64)
    model = m.build_model(cfg, 8196)  # the paper's counts use V = 8196
    assert sum(p.numel() for p in model.blocks[0].mixer.parameters()) == 16_448
    assert sum(p.numel() for p in model.blocks.parameters()) == 99_584
    assert sum(p.numel() for p in model.parameters()) == 689_792
    assert model.pos_emb is not None and m.build_model(m.Config(pos_emb="off"), 10).pos_emb is None
    w = model.blocks[0].mixer.out_proj.weight
    assert abs(w.std().item() - 0.01) < 0.001, "out_proj is N(0, 0.02/sqrt(2*n_layers))"
    assert abs(model.blocks[0].mixer.Wqkv.weight.std().item() - 0.02) < 0.001
    assert (model.blocks[0].mixer.out_proj.bias == 0).all()
    assert torch.equal(m.build_model(cfg, 50).embed.weight, m.build_model(cfg, 50).embed.weight)
    scaled = lambda arch: sorted(n for n, mod in m.build_model(m.Config(arch=arch, d_model=16), 50).named_modules()
                                 if getattr(mod, "writes_residual", False))  # zoology's out_proj / fc2, by role
    assert scaled("based") == ["blocks.0.mlp.fc2", "blocks.1.mlp.fc2"]  # Based's proj_o keeps N(0, 0.02)
    assert scaled("mamba") == ["blocks.0.mixer.out_proj", "blocks.1.mixer.out_proj"]


def test_mamba_block_norm_is_mambas_rmsnorm():
    model = m.build_model(small_ar(arch="mamba", d_model=16), 53)
    for block in model.blocks:  # weight only, eps 1e-5 (mamba_ssm's RMSNorm), no MLP
        assert isinstance(block.norm1, torch.nn.RMSNorm) and block.norm1.eps == 1e-5 and block.mlp is None
    x = torch.randn(2, 5, 16) * 1e-3  # where eps matters: r / sqrt(mean(r²) + eps) · w
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(model.blocks[0].norm1(x), want, rtol=1e-5, atol=1e-7)


def test_batches_cover_each_epoch_and_trim_padding():
    lengths = torch.tensor([3, 40, 17, 100, 9, 64])
    compiled, plain = m.Batches(lengths, 2, seed=0, compile=True), m.Batches(lengths, 2, seed=0)
    seen = []
    for _ in range(3):  # one epoch: every document once, in the same order with or without compile
        (idx, L), (idx2, L2) = compiled.next(), plain.next()
        longest = int(lengths[idx].max())
        assert torch.equal(idx, idx2) and L2 == longest
        assert L == min(100, max(16, 1 << (longest - 1).bit_length())) and L >= longest  # a power of two, or all
        seen += idx.tolist()
    assert sorted(seen) == list(range(6))
    state = plain.state_dict()
    again = m.Batches(lengths, 2, seed=0)
    again.load_state_dict(state)
    assert torch.equal(again.next()[0], plain.next()[0]), "a restored batch order continues identically"


def test_fixed_batch_order_is_the_stored_order_every_epoch():
    fixed = m.Batches(torch.full((11,), 5), 3, seed=0, fixed=True)  # 3 batches an epoch, documents 9 and 10 dropped
    want = [[0, 1, 2], [3, 4, 5], [6, 7, 8]] * 3                      # batch k = documents [3k, 3k+3), every epoch
    assert [fixed.next()[0].tolist() for _ in range(9)] == want
    shuffled = m.Batches(torch.full((11,), 5), 3, seed=0)
    epochs = [sum((shuffled.next()[0].tolist() for _ in range(3)), []) for _ in range(2)]
    assert epochs[0] != epochs[1] and epochs[0] != sum(want[:3], []), "shuffle draws a new order each epoch"


def test_lr_schedule_warmup_then_cosine_to_zero():
    f = [m.lr_factor(s, 10, 100) for s in range(101)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert f[55] == pytest.approx(0.5, abs=1e-6) and f[100] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))


# -------------------------------------------------------------------------------------------- learning

@pytest.fixture(scope="module")
def trained_small_ar(tmp_path_factory):
    """Attention trained on a small AR until 95 % accuracy, with its mechanism grid. Four pairs, not two:
    with two pairs a model can answer by exclusion (the query is not the other key), which muddies the
    mechanism. The induction phase transition comes after ~2,000 steps of 256 documents."""
    cfg = m.Config(n_pairs=4, n_keys=16, n_values=16, d_model=48, n_train=50_000, batch_size=256,
                   steps=3500, lr=1e-3, eval_every=250, analyze_every=250, target_acc=0.95,
                   out_dir=str(tmp_path_factory.mktemp("runs")))
    return cfg, m.train(cfg, log=lambda s: None)


def test_attention_learns_small_ar(trained_small_ar):
    cfg, res = trained_small_ar
    assert res["final_acc"] >= 0.95, res["history"][-3:]
    assert res["status"] == "target reached"


def test_trained_attention_shows_induction(trained_small_ar):
    cfg, res = trained_small_ar
    mech = res["mechanism"]
    a = {(g["site"], g["layer"], g["position"]): g["attribution"] for g in mech["grid"]}
    assert mech["p_clean"] - mech["p_corrupt"] > 0.3
    assert mech["acc_corrupt"] < 0.5 < res["final_acc"], "a corrupted key costs the answer"
    _, model = m.load_run(os.path.join(cfg.out_dir, cfg.run_name))
    few = m.mechanism(model, m.make_task(cfg, train=False), seed=cfg.seed, cells=[("block_input", 1, "value")])
    assert few["verdict"] is None and few["grid"][0]["attribution"] == pytest.approx(a["block_input", 1, "value"])
    assert a["block_input", 1, "value"] >= 0.9, mech["verdict"]
    assert a["block_input", 1, "query"] <= 0.2, mech["verdict"]
    assert a["block_input", 0, "key"] == pytest.approx(1.0, abs=1e-4), "restoring the corrupted token itself"
    assert a["block_output", 1, "query"] == pytest.approx(1.0, abs=1e-4), "the last residual decides"
    assert mech["verdict"]["kind"] == "induction"
    saved = json.loads(open(os.path.join(cfg.out_dir, cfg.run_name, "results.json")).read())
    assert saved["mechanism"]["grid"] == mech["grid"]


def test_the_history_shows_induction_forming(trained_small_ar):
    """analyze_every=250: every evaluation step holds a check of the mechanism. Early on the key does not matter
    (no verdict); at the end the check reads what the full grid reads, number for number."""
    cfg, res = trained_small_ar
    history = res["history"]
    assert [h["step"] for h in history if "verdict" in h] == [h["step"] for h in history] == \
        list(range(250, res["steps_done"] + 1, 250))
    first, last = history[0], history[-1]
    assert first["verdict"]["kind"] != "induction" and first["acc"] < 0.5
    assert last["verdict"] == res["mechanism"]["verdict"] and last["verdict"]["kind"] == "induction"
    grid = {g["position"]: g["attribution"] for g in res["mechanism"]["grid"] if (g["site"], g["layer"]) == ("block_input", 1)}
    assert last["verdict"]["reads"] == {k: grid[k] for k in ("value", "key", "next_key", "query")}
    assert last["gap"] == pytest.approx(res["mechanism"]["p_clean"] - res["mechanism"]["p_corrupt"], abs=1e-12)
    _, model = m.load_run(os.path.join(cfg.out_dir, cfg.run_name))
    task = m.make_task(cfg)
    assert last["train_acc"] == m.evaluate(model, task.train[:cfg.n_eval])["acc"] >= 0.9


def test_watching_the_mechanism_never_changes_training(tmp_path):
    """The same run with and without analyze_every: the same losses, evaluations and final weights, bit for bit;
    the checks at the first evaluation from each multiple of analyze_every on, and in the progress line."""
    cfg = small_ar(d_model=16, steps=40, eval_every=10, analyze_every=0, target_acc=0, analyze=False,
                   out_dir=str(tmp_path), run_name="plain")
    lines = []
    plain, watched = m.train(cfg, log=lambda s: None), m.train(m.replace(cfg, analyze_every=20, run_name="watched"),
                                                                log=lines.append)
    keys = ("step", "loss", "acc", "p_answer", "lr")
    assert [{k: h[k] for k in keys} for h in watched["history"]] == plain["history"]
    assert [h["step"] for h in watched["history"] if "verdict" in h] == [20, 40]
    assert all(h.keys() == {*keys, "train_acc", "gap", "verdict"} for h in watched["history"][1::2])
    a, b = (torch.load(tmp_path / r / "model.pt", weights_only=True)["model"] for r in ("plain", "watched"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    step20 = next(l for l in lines if l.startswith("step     20"))
    assert f"| train acc {watched['history'][1]['train_acc']:.4f}, " in step20
    assert step20.endswith(m.verdict_text(watched["history"][1]["verdict"], numbers=False))
    assert "train acc" not in next(l for l in lines if l.startswith("step     10"))
    with pytest.raises(m.ConfigError, match="analyze_every=20 is not a multiple of eval_every=15"):
        m.replace(cfg, eval_every=15, steps=60, analyze_every=20)  # it would check at steps 30, 45 and 60
    odd = m.train(m.replace(cfg, eval_every=15, steps=50, analyze_every=30, run_name="odd"), log=lambda s: None)
    assert [h["step"] for h in odd["history"] if "verdict" in h] == [30]  # not at 45, nor at the last step, 50


# ------------------------------------------------------------------------------------ interventions

def tiny_model(arch, n_layers=2, seed=0, task=None):
    cfg = m.replace(task or small_ar(n_eval=6), arch=arch, d_model=16, n_layers=n_layers, seed=seed, run_name="")
    model = m.build_model(cfg, m.make_task(cfg, train=False).vocab_size)
    model.arch = arch
    for p in model.parameters():  # larger weights than the init, so every site matters
        torch.nn.init.normal_(p, std=0.3) if p.dim() > 1 else torch.nn.init.uniform_(p, -0.5, 0.5)
    return cfg, model.eval()


# The short convolution of each mixer that has one, named here independently of mecheval's lookup.
CONVS = {"mamba": "conv1d", "deltanet": "conv1d", "hyena": "short_filter", "based": "conv", "base_conv": "conv"}


def golden_forward(model, ids, splice=None):
    """The model's forward written out by hand. splice = (site, layer, positions, values): overwrite
    that activation at one position per row. Returns logits and every activation seen. conv_output is
    reached by wrapping the mixer's short convolution for this call (no hooks)."""
    acts, rows = {}, torch.arange(len(ids))

    def at(site, layer, x):
        if splice and splice[:2] == (site, layer):
            x = x.clone()
            x[rows, splice[2]] = splice[3]
        acts[site, layer] = x
        return x

    x = model.embed(ids)
    if model.pos_emb is not None:
        x = x + model.pos_emb.weight[:ids.shape[1]]
    for layer, blk in enumerate(model.blocks):
        conv = getattr(blk.mixer, CONVS.get(model.arch, ""), None)
        if isinstance(conv, m.ShortConv):
            conv.forward = lambda u, conv=conv, layer=layer: at("conv_output", layer, type(conv).forward(conv, u))
        x = at("block_input", layer, x)
        x = x + at("mixer_output", layer, blk.mixer(at("mixer_input", layer, blk.norm1(x))))
        if isinstance(conv, m.ShortConv):
            del conv.forward
        if blk.mlp is not None:
            x = x + at("mlp_output", layer, blk.mlp(at("mlp_input", layer, blk.norm2(x))))
        x = at("block_output", layer, x)
    return model.ln_f(x) @ model.embed.weight.T, acts


def interchange(model, corrupted_ids, clean_ids, site, layer, positions, sites=m.SITES):
    """One interchange intervention by mecheval's two steps: read the clean activation, patch it into the corrupted
    run; the logits (B, L, V). mechanism takes the same steps for a whole grid."""
    read = {}
    with m.hooks(model, {(site, layer): m.read_at({"x": positions}, read)}, sites):
        model(clean_ids)
    return m.logits_of(m.patch(model, corrupted_ids, site, layer, positions, read["x",], sites=sites))


@pytest.mark.parametrize("arch", sorted(m.ARCHS))
def test_interchange_matches_golden_forward(arch):
    cfg, model = tiny_model(arch)
    gen = torch.Generator().manual_seed(1)
    base, source = torch.randint(3, 53, (4, 13), generator=gen), torch.randint(3, 53, (4, 13), generator=gen)
    positions = torch.tensor([0, 5, 12, 7])
    with torch.no_grad():
        _, src_acts = golden_forward(model, source)
        for (site, layer), act in src_acts.items():
            want, _ = golden_forward(model, base, (site, layer, positions, act[torch.arange(4), positions]))
            got = interchange(model, base, source, site, layer, positions)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{arch} {site} layer {layer}")
        per_layer = len(m.SITES) - (2 if model.blocks[0].mlp is None else 0) - 1  # Mamba: no mlp_* sites
        convs = {"mamba": 2, "deltanet": 2, "hyena": 2, "based": 1, "base_conv": 1}.get(arch, 0)  # layers with one
        assert len(src_acts) == per_layer * cfg.n_layers + convs
        assert sorted(src_acts) == sorted(m.model_sites(model))


def test_conv_output_exists_only_where_a_mixer_calls_a_short_conv():
    for arch, layers in (("attention", ()), ("h3", ()), ("based", (0,)), ("base_conv", (0,)), ("mamba", (0, 1))):
        _, model = tiny_model(arch)
        for layer in range(2):
            if layer in layers:
                assert isinstance(m.site_module(model, "conv_output", layer), m.ShortConv)
            else:
                assert m.site_module(model, "conv_output", layer) is None
                with pytest.raises(ValueError, match=f"site 'conv_output' does not exist in layer {layer} of"):
                    interchange(model, torch.ones(1, 5, dtype=torch.long), torch.ones(1, 5, dtype=torch.long),
                                  "conv_output", layer, torch.tensor([2]))
    cfg = small_ar(arch="mamba", d_conv="0", d_model=16)
    model = m.build_model(cfg, 53)  # d_conv 0: the conv parameters exist but no convolution runs
    with pytest.raises(ValueError, match="site 'conv_output' does not exist in layer 0 of this model"):
        interchange(model, torch.ones(1, 5, dtype=torch.long), torch.ones(1, 5, dtype=torch.long), "conv_output", 0,
                      torch.tensor([2]))
    assert no_hooks(model)


@pytest.mark.parametrize("arch", ["attention", "based"])  # based: conv_output too
def test_interchange_identities(arch):
    cfg, model = tiny_model(arch)
    gen = torch.Generator().manual_seed(2)
    base, source = torch.randint(3, 53, (3, 11), generator=gen), torch.randint(3, 53, (3, 11), generator=gen)
    with torch.no_grad():
        clean, src_logits = model(base), model(source)
        for site, layer in m.model_sites(model):
            same = interchange(model, base, base, site, layer, torch.tensor([1, 4, 9]))
            torch.testing.assert_close(same, clean, rtol=1e-6, atol=1e-7)
            later = interchange(model, base, source, site, layer, torch.tensor([8, 9, 10]))
            torch.testing.assert_close(later[:, :8], clean[:, :8], rtol=0, atol=0)
        for t in range(11):  # the last block's output at t decides the logits at t
            out = interchange(model, base, source, "block_output", cfg.n_layers - 1, torch.full((3,), t))
            torch.testing.assert_close(out[:, t], src_logits[:, t], rtol=1e-5, atol=1e-6)
        skip = interchange(model, base, source, "block_input", 0, torch.tensor([-1, -1, -1]))
        torch.testing.assert_close(skip, clean, rtol=0, atol=0)


def no_hooks(model):
    return all(not mod._forward_hooks and not mod._forward_pre_hooks for mod in model.modules())


def test_hooks_are_removed_even_when_the_model_raises():
    cfg, model = tiny_model("attention")
    good, bad = torch.randint(3, 53, (2, 9)), torch.full((2, 9), 10_000)  # bad: out of the vocabulary
    pos = torch.tensor([3, 4])
    interchange(model, good, good, "mixer_output", 1, pos)
    assert no_hooks(model)
    for base, source in ((good, bad), (bad, good)):
        with pytest.raises(IndexError):
            interchange(model, base, source, "mlp_input", 0, pos)
        assert no_hooks(model)
    with pytest.raises(ValueError, match="unknown site"):
        interchange(model, good, good, "attention_output", 0, pos)
    model.blocks[0].mlp = None  # as in a Mamba block
    with pytest.raises(ValueError, match="site 'mlp_output' does not exist in layer 0 of this model"):
        interchange(model, good, good, "mlp_output", 0, pos)
    assert no_hooks(model)


@pytest.mark.parametrize("task_name", ["ar", "atr"])
def test_mechanism_batched_equals_one_document_at_a_time(task_name):
    """The batched grid against one unpadded document at a time; ATR's documents differ in length, so the
    batch is padded and its positions differ per document."""
    cfg, model = tiny_model("attention") if task_name == "ar" else tiny_model("attention", task=small_atr(n_eval=8))
    task = m.make_task(cfg, train=False)
    forwards = []
    model.embed.register_forward_hook(lambda *args: forwards.append(1))  # every forward embeds its tokens once
    mech = m.mechanism(model, task, "key", seed=5)
    assert len(forwards) == mech["forwards"] == 2 + 6 * 2 * 5  # clean, corrupted, 6 sites x 2 layers x 5 positions
    base = m.corrupt_tokens(task, task.eval, "key", torch.Generator().manual_seed(5))
    clean, ans, q, lengths = task.eval.input_ids, task.eval.answers, task.eval.pos["query"], task.eval.lengths
    if task_name == "atr":
        assert lengths.min() < lengths.max(), "documents of several lengths, so some are padded"
    with torch.no_grad():  # the corrupted run's accuracy, document by document
        right = [m.answer_logits(model, base[n:n + 1, :int(lengths[n])], q[n:n + 1])[0].argmax() == ans[n]
                 for n in range(len(clean))]
    assert mech["acc_corrupt"] == pytest.approx(torch.stack(right).float().mean().item())
    few = m.mechanism(model, task, "key", seed=5, cells=[("block_input", 1, "value")])
    cell = next(g for g in mech["grid"] if (g["site"], g["layer"], g["position"]) == ("block_input", 1, "value"))
    assert few["grid"] == [cell]  # one cell alone reads as it does in the whole grid
    for cell in mech["grid"][::5]:
        pos, ps = task.eval.pos[cell["position"]], []
        for n in range(len(clean)):
            if pos[n] < 0:
                continue
            one = slice(n, n + 1), slice(0, int(lengths[n]))
            with torch.no_grad():
                logits = interchange(model, base[one], clean[one], cell["site"], cell["layer"], pos[n:n + 1])
            ps.append(logits[0, q[n]].softmax(-1)[ans[n]])
        assert cell["p_patched"] == pytest.approx(torch.stack(ps).mean().item(), rel=1e-5, abs=1e-7)


class ForeignAttention(torch.nn.Module):
    """Hugging Face's way: called with a mask, returns a tuple (output, weights)."""

    def __init__(self, d):
        super().__init__()
        self.c_attn, self.c_proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x, mask=None):  # no mask: every position attends to every other, silently
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool) if mask is None else mask
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        w = (q @ k.transpose(1, 2) / math.sqrt(x.shape[-1])).masked_fill(~mask, float("-inf")).softmax(-1)
        return self.c_proj(w @ v), w


class ForeignBlock(torch.nn.Module):
    """Called as block(x, mask, scale); without its mask (what a pre-hook that returns a bare tensor leaves) it
    attends to every position, silently. Returns a tuple, as Hugging Face's blocks do."""

    def __init__(self, d):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = torch.nn.LayerNorm(d), ForeignAttention(d), torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x, mask=None, scale=1.0):
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool) if mask is None else mask
        x = x + scale * self.attn(self.ln_1(x), mask)[0]
        return x + self.mlp(self.ln_2(x)), mask


class ForeignGPT(torch.nn.Module):
    """A GPT of other names than mecheval's (nanoGPT's and GPT-2's), returning (logits, loss) as nanoGPT does."""

    def __init__(self, vocab_size, d=16, n_layer=2):
        super().__init__()
        self.transformer = torch.nn.ModuleDict(dict(
            wte=torch.nn.Embedding(vocab_size, d), wpe=torch.nn.Embedding(64, d),
            h=torch.nn.ModuleList(ForeignBlock(d) for _ in range(n_layer)), ln_f=torch.nn.LayerNorm(d)))
        self.lm_head = torch.nn.Linear(d, vocab_size, bias=False)

    def forward(self, ids):
        t, L = self.transformer, ids.shape[1]
        x = t.wte(ids) + t.wpe(torch.arange(L))
        for block in t.h:
            x = block(x, torch.ones(L, L, dtype=torch.bool).tril(), 0.5)[0]
        return self.lm_head(t.ln_f(x)), None


def foreign_golden(model, ids, splice=None, acts=None):
    """ForeignGPT's forward written out, no hooks: with splice = (site, layer, positions, values) that activation
    replaced (position -1: none); every activation stored into acts."""
    rows = torch.arange(len(ids))

    def at(site, layer, x):
        if splice is not None and splice[:2] == (site, layer):
            x, has = x.clone(), splice[2] >= 0
            x[rows[has], splice[2][has]] = splice[3][has]
        if acts is not None:
            acts[site, layer] = x
        return x
    t, L = model.transformer, ids.shape[1]
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    x = t.wte(ids) + t.wpe(torch.arange(L))
    for layer, b in enumerate(t.h):
        x = at("block_input", layer, x)
        x = x + 0.5 * at("mixer_output", layer, b.attn(at("mixer_input", layer, b.ln_1(x)), mask)[0])
        x = x + at("mlp_output", layer, b.mlp(at("mlp_input", layer, b.ln_2(x))))
        x = at("block_output", layer, x)
    return model.lm_head(t.ln_f(x))


def readme_text(title):
    text = open(os.path.join(HERE, "README.md")).read()
    return text[text.index(f"## {title}\n"):].split("\n## ")[0]


def copied_interventions():
    """A fresh namespace holding exactly what the README's "Your own model" says to copy: its imports, then the
    source of each named definition from mecheval.py, in its order. Nothing else is injected."""
    import ast
    recipe = readme_text("Your own model").split("**Copy**")[1].split("\n- **")[0]
    code = [c.strip("`") for c in re.findall(r"`[^`]+`", recipe) if c.startswith("`")]
    imports, names = [c for c in code if c.startswith(("import ", "from "))], [c for c in code if c.isidentifier()]
    src = open(m.__file__).read()
    lines, defs = src.split("\n"), {}
    for node in ast.parse(src).body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        targets = [t for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        for name in [node.name] if hasattr(node, "name") else [t.id for t in targets]:
            defs[name] = "\n".join(lines[first - 1:node.end_lineno])
    ns = {}
    exec("\n".join(imports), ns)
    for name in names:
        exec(defs[name], ns)
    sites = re.search(r"(GPT2_SITES = \{.*?\})\n", readme_text("Your own model"), re.S).group(1)
    exec(sites, ns)
    return ns, names, sum(defs[n].count("\n") + 1 for n in names)


def test_the_readme_copy_list_runs_the_grid_on_a_foreign_model():
    """The README's copy list, alone in a fresh namespace, on a GPT of other names whose blocks take extra
    positional arguments and whose attention and blocks return tuples: every cell equals the hand-written splice."""
    ns, names, n_lines = copied_interventions()
    assert {"mechanism", "hooks", "verdict", "format_mechanism", "check_inputs"} <= set(names)
    assert not {"ShortConv", "LanguageModel", "Block", "MAX_LEN"} & set(names)
    assert n_lines == pytest.approx(int(re.search(r"about (\d+) lines", readme_text("Your own model"))[1]), abs=10)
    task = m.make_task(small_ar(n_eval=12), train=False)
    torch.manual_seed(0)
    model = ForeignGPT(task.vocab_size).eval()
    for p in model.parameters():  # larger weights than an init, so every site matters
        torch.nn.init.normal_(p, std=0.3) if p.dim() > 1 else torch.nn.init.uniform_(p, -0.5, 0.5)
    mech = ns["mechanism"](model, task, seed=4, sites=ns["GPT2_SITES"])
    assert len(mech["grid"]) == 6 * 2 * 5 and mech["n_layers"] == 2
    clean, pos = task.eval.input_ids, task.eval.pos
    corrupted = m.corrupt_tokens(task, task.eval, "key", torch.Generator().manual_seed(4))
    p = lambda logits: logits[torch.arange(len(clean)), pos["query"]].softmax(-1)[torch.arange(len(clean)),
                                                                                  task.eval.answers]
    acts = {}
    with torch.no_grad():
        p_clean, p_corrupt = p(foreign_golden(model, clean, acts=acts)), p(foreign_golden(model, corrupted))
        assert mech["p_clean"] == pytest.approx(p_clean.mean().item(), rel=1e-5)
        for cell in mech["grid"]:
            at = pos[cell["position"]]
            values = acts[cell["site"], cell["layer"]][torch.arange(len(clean)), at.clamp(min=0)]
            patched = p(foreign_golden(model, corrupted, (cell["site"], cell["layer"], at, values)))
            has = at >= 0
            assert cell["p_patched"] == pytest.approx(patched[has].mean().item(), rel=1e-5, abs=1e-7), cell
            assert cell["p_corrupt"] == pytest.approx(p_corrupt[has].mean().item(), rel=1e-5, abs=1e-7)
    assert ns["format_mechanism"](mech).splitlines()[-1].startswith("verdict: ")


def test_a_foreign_model_with_a_wrong_mapping_or_split_gets_one_sentence():
    task = m.make_task(small_ar(n_eval=4), train=False)
    model = ForeignGPT(task.vocab_size).eval()
    sites = {"block_input": "transformer.h.{layer}", "mlp_input": "transformer.h.{layer}.mpl"}
    with pytest.raises(ValueError, match=r"^site 'mlp_input' of layer 0: the model has no module 'transformer.h.0.mpl'$"):
        m.mechanism(model, task, sites=sites)
    with pytest.raises(ValueError, match="^site 'block_input' of layer 0: the model has no module 'h'$"):
        m.mechanism(model, task, sites={"block_input": "h.{layer}"})
    for block in model.transformer.h:
        block.unused = torch.nn.Linear(2, 2)  # in the model, never called: its hooks would change nothing
    with pytest.raises(ValueError, match="^site 'mlp_output' of layer 0: its module did not run in the forward$"):
        m.mechanism(model, task, sites={"block_input": "transformer.h.{layer}", "mlp_output": "transformer.h.{layer}.unused"})
    gpt2 = {"block_input": "transformer.h.{layer}"}
    model.transformer.h[0].drop = torch.nn.Dropout(0.1)
    with pytest.raises(ValueError, match=r"^the model is in training mode and has dropout: call model.eval\(\) first$"):
        m.mechanism(model.train(), task, sites=gpt2)
    model.eval()

    class LastOnly(torch.nn.Module):  # nanoGPT's GPT without targets: the last position's logits only
        def __init__(self):
            super().__init__()
            self.gpt = model

        def forward(self, ids):
            return self.gpt(ids)[0][:, -1:]
    with pytest.raises(ValueError, match=r"^the model gave logits of shape \(4, 1, \d+\) for ids of shape \(4, \d+\); "):
        m.mechanism(LastOnly().eval(), task, sites={"block_input": "gpt.transformer.h.{layer}"})
    split = m.Split(task.eval.input_ids, {k: v for k, v in task.eval.pos.items() if k != "next_key"}, task.eval.lengths)
    with pytest.raises(ValueError, match=r"^mechanism needs split.pos\['next_key'\] \(see check_inputs\)$"):
        m.mechanism(model, task, split=split, sites={"block_input": "transformer.h.{layer}"})
    with pytest.raises(ValueError, match=r"^mechanism needs task.classes\['value'\]"):
        m.mechanism(model, m.replace(task, classes={"key": task.classes["key"]}), corrupt="value",
                    sites={"block_input": "transformer.h.{layer}"})
    for cells in ([], [("block_input", 0, "answer_pos")], [("block_input", 5, "key")]):
        with pytest.raises(ValueError, match="^cells must be a non-empty list of"):
            m.mechanism(model, task, cells=cells, sites={"block_input": "transformer.h.{layer}"})


def test_a_host_init_then_reset_parameters_builds_mamba_as_mecheval_does():
    """A host model's usual init (nanoGPT's: N(0, 0.02) on every Linear, biases zeroed) overwrites Mamba's Δ; the
    README's recipe, reset_parameters() after it, restores mecheval's own init."""
    import types
    cfg = types.SimpleNamespace(d_model=32, d_conv="auto", n_layers=3)  # what the README says a copy needs
    ours = m.build_model(m.Config(arch="mamba", d_model=32, n_layers=3), 10).blocks[1].mixer
    torch.manual_seed(1)
    host = m.Mamba(cfg, 1)

    def nanogpt_init(mod):
        if isinstance(mod, torch.nn.Linear):
            torch.nn.init.normal_(mod.weight, std=0.02)
            if mod.bias is not None:
                torch.nn.init.zeros_(mod.bias)
    host.apply(nanogpt_init)
    softplus = lambda mixer: torch.nn.functional.softplus(mixer.dt_proj.bias)  # Δ at a zero input
    assert softplus(host).sub(math.log(2)).abs().max() < 1e-6, "the host's init leaves Δ = ln 2 everywhere"
    host.reset_parameters()
    for mixer in (ours, host):
        assert 1e-3 * 0.999 <= softplus(mixer).min() and softplus(mixer).max() <= 0.1 * 1.001
        assert softplus(mixer).log().std() > 0.9, "log-uniform over [1e-3, 1e-1]: std 1.33"
        r = mixer.dt_proj.in_features
        assert mixer.dt_proj.weight.abs().max() <= r ** -0.5 and mixer.dt_proj.weight.std() > 0.8 * r ** -0.5 / 3 ** 0.5
        torch.testing.assert_close(mixer.A_log, torch.log(torch.arange(1., 17.)).repeat(64, 1))
        assert (mixer.D == 1).all()
        for lin, scale in ((mixer.in_proj, 1), (mixer.x_proj, 1), (mixer.out_proj, 3 ** -0.5)):
            bound = scale / lin.in_features ** 0.5  # PyTorch's default: U(±1/√fan_in), out_proj / √n_layers
            assert lin.weight.abs().max() <= bound and lin.weight.abs().max() > 0.95 * bound
    for a, b in zip(ours.state_dict().values(), host.state_dict().values()):
        assert a.shape == b.shape


def test_corruption_draws_another_token_of_the_same_class():
    for cfg in (small_ar(n_eval=300), small_atr(n_eval=300)):
        task = m.make_task(cfg, train=False)
        for which in ("key", "value"):
            ids = m.corrupt_tokens(task, task.eval, which, torch.Generator().manual_seed(0))
            rows, at = torch.arange(300), task.eval.pos[which]
            old, new = task.eval.input_ids[rows, at], ids[rows, at]
            lo, hi = task.classes[which]
            assert (new != old).all() and ((new >= lo) & (new < hi)).all()
            changed = (ids != task.eval.input_ids).sum(1)
            assert (changed == 1).all(), "exactly one token changes"
            assert len(set(new.tolist())) > (hi - lo) // 2, "draws spread over the class"


def fake_mech(n_layers, values, p_clean=0.9, p_corrupt=0.1):
    grid = [{"site": s, "layer": l, "position": k, "attribution": values.get((s, l, k), 0.0)}
            for l in range(n_layers) for s in m.SITES for k in m.POSITIONS]
    return {"p_clean": p_clean, "p_corrupt": p_corrupt, "acc_corrupt": 0.0, "n_layers": n_layers, "grid": grid}


def test_verdict_reads_the_grid_like_the_paper():
    last = lambda L: {("block_output", L - 1, "query"): 1.0}
    kind = lambda mech: (m.verdict(mech)["kind"], m.verdict(mech)["layer"])
    v = m.verdict(fake_mech(2, {**last(2), ("block_input", 1, "value"): 0.95}))
    assert (v["kind"], v["layer"], v["reads"]["value"]) == ("induction", 1, 0.95)
    assert m.verdict_text(v).startswith("induction (layer-1 block_input attribution: value 0.95")
    v = m.verdict(fake_mech(2, {**last(2), ("block_output", 0, "query"): 0.9, ("block_input", 1, "query"): 0.9}))
    assert m.verdict_text(v, numbers=False) == "direct retrieval in layer 0"
    v = m.verdict({**fake_mech(2, {**last(2), ("block_input", 1, "value"): 0.95}), "query": "sibling"})  # App. D.4
    assert v["kind"] == m.verdict_text(v) == "not read (sibling queries)"
    assert kind(fake_mech(2, {**last(2), ("block_input", 1, "key"): 0.8})) == ("direct retrieval", 1)
    v = m.verdict(fake_mech(2, {**last(2), ("block_input", 1, "next_key"): 0.8}))
    assert m.verdict_text(v, numbers=False) == "direct retrieval in layer 1 from the next key"
    assert kind(fake_mech(2, {**last(2), ("block_input", 1, "key"): 0.3, ("block_input", 1, "value"): 0.3}))[0] == "mixed"
    v = m.verdict(fake_mech(2, {}, p_clean=0.5, p_corrupt=0.495))
    assert v["kind"] == "no verdict" and m.verdict_text(v).startswith("no verdict (the corruption does not hurt")
    assert kind(fake_mech(3, {**last(3), ("block_output", 1, "query"): 0.9, ("block_input", 1, "value"): 0.9})) \
        == ("induction", 1)
    assert kind(fake_mech(1, last(1))) == ("direct retrieval", 0)
    table = m.format_mechanism({**fake_mech(2, {("block_input", 1, "value"): 0.95}), "corrupt": "key",
                                "n_docs": 3, "verdict": None})
    assert "block_input" in table and "█  0.95" in table and table.count("\n") == 2 + 2 * len(m.SITES)


B1 = lambda k: ("block_input", 1, k)  # the cell the 2-layer verdict reads, at position k
LAST = {("block_output", 1, "query"): 1.0}


@pytest.mark.parametrize("cells, p_corrupt, want", [
    ({**LAST, B1("value"): 0.5}, 0.1, ("induction", 1)),                      # exactly the threshold counts
    ({**LAST, B1("value"): 0.4999}, 0.1, ("mixed", 1)),                       # just under it does not
    ({**LAST, B1("value"): 0.6, B1("key"): 0.6}, 0.1, ("mixed", 1)),          # a tie names no position
    ({**LAST, B1("key"): 0.7, B1("next_key"): 0.7}, 0.1, ("mixed", 1)),
    ({**LAST, B1("value"): -0.2, B1("key"): -0.3, B1("next_key"): -0.1, B1("query"): -0.5}, 0.1, ("mixed", 1)),
    ({B1("value"): 0.9}, 0.1, ("induction", 1)),                              # no layer decides: the last block
    ({("block_output", 0, "query"): 0.5, B1("value"): 0.9}, 0.1, ("direct retrieval", 0)),  # exactly 0.5 decides
    ({**LAST, B1("value"): 0.9}, 0.9, ("no verdict", None)),                  # the corruption does not hurt
    ({**LAST, B1("value"): 0.9}, 0.95, ("no verdict", None)),                 # it helps
    ({**LAST, B1("value"): 0.9}, 0.88, ("induction", 1)),                     # it hurts by 0.02
])
def test_verdict_edge_cases(cells, p_corrupt, want):
    v = m.verdict(fake_mech(2, cells, p_clean=0.9, p_corrupt=p_corrupt))
    assert (v["kind"], v["layer"]) == want


# ------------------------------------------------------------------------------------------------- CLI

@pytest.mark.parametrize("argv, words", [
    (["--arch", "transformer"], ["arch", "transformer", "attention"]),
    (["--task", "mqar"], ["task", "mqar", "ar, atr"]),
    (["--d_model", "0"], ["d_model", "0"]),
    (["--n_pairs", "40", "--n_keys", "30"], ["n_pairs=40", "n_keys=30"]),
    (["--atr_setting", "hard", "--task", "atr"], ["atr_setting", "hard", "easy, medium, 8192"]),
    (["--atr_split", "gen"], ["atr_split", "task=ar"]),
    (["--batch_size", "64", "--n_train", "10"], ["batch_size=64", "n_train=10"]),
    (["--lr", "-1"], ["lr", "-1"]),
    (["--warmup", "1"], ["warmup", "[0, 1)", "1.0"]),
    (["--beta2", "1"], ["beta2", "[0, 1)", "1.0"]),
    (["--task", "atr", "--atr_query", "root"], ["atr_query", "root", "parent, inner, sibling"]),
    (["--target_acc", "1.5"], ["target_acc", "[0, 1]", "1.5"]),
    (["--task", "atr", "--atr_split", "gen", "--atr_heldout", "0"], ["atr_heldout", "(0, 1)", "0.0"]),
    (["--pos_emb", "yes"], ["pos_emb", "yes", "auto, on, off"]),
    (["--batch_order", "random"], ["batch_order", "random", "shuffle, fixed"]),
    (["--sweep", "--widths", "16,0"], ["d_model", "0"]),
    (["--analyze_every", "-250"], ["analyze_every must be 0 (none) or more, not -250"]),
    # settings that would be silently ignored, a folder outside out_dir, loops that never end, sizes that cannot fit
    (["--run_name", "../x"], ["run_name '../x'", "one folder name"]),
    (["--run_name", "/tmp/x"], ["run_name '/tmp/x'"]),
    (["--run_name", ".."], ["run_name '..'"]),
    (["--atr_heldout", "0.3"], ["atr_heldout=0.3", "generalisation split"]),
    (["--task", "atr", "--atr_heldout", "0.3"], ["atr_heldout=0.3", "--atr_split gen"]),
    (["--task", "atr", "--n_keys", "100"], ["n_keys=100 is an AR option", "task=atr"]),
    (["--atr_setting", "medium"], ["atr_setting=medium is an ATR option", "task=ar"]),
    (["--steps", "100", "--analyze_every", "500"], ["analyze_every=500", "100 steps", "no check would run"]),
    (["--sweep", "--load", "x"], ["--sweep and --load do not go together"]),
    (["--task", "atr", "--atr_split", "gen", "--atr_heldout", "0.0001"], ["atr_heldout=0.0001", "0 of the 400"]),
    (["--task", "atr", "--atr_split", "gen", "--atr_heldout", "0.9999"], ["atr_heldout=0.9999", "400 of the 400"]),
    (["--n_keys", "300000000"], ["n_keys=300000000", "at most 10,000,000"]),
    (["--d_model", "1000000000", "--n_train", "64", "--n_eval", "8"], ["does not fit in memory", "d_model"]),
])
def test_cli_rejects_bad_values(argv, words, capsys, tmp_path):
    assert m.main(argv + ["--out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    for w in words:
        assert w in err
    assert not os.listdir(tmp_path), "nothing is written for a rejected config"


@pytest.mark.parametrize("kw, words", [
    (dict(d_model="16"), "d_model must be an integer, not '16'"), (dict(lr="1e-3"), "lr must be a number, not '1e-3'"),
    (dict(n_pairs=2.5), "n_pairs must be an integer, not 2.5"), (dict(steps=20.7), "steps must be an integer, not 20.7"),
    (dict(compile=1), "compile must be True or False, not 1"), (dict(seed=True), "seed must be an integer, not True"),
    (dict(arch="mamba", d_conv=2000), "d_conv=2000 is not a width for mamba; allowed: 0 to 1024"),
])
def test_config_checks_types_in_one_sentence(kw, words):
    with pytest.raises(m.ConfigError, match=re.escape(words)):
        m.Config(**kw)


def test_config_takes_numpy_numbers_and_an_int_width():
    cfg = m.Config(arch="mamba", d_conv=3, d_model=m.np.int64(32), lr=m.np.float32(0.5))
    assert (cfg.d_conv, type(cfg.d_model), type(cfg.lr)) == ("3", int, float)
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'arch'"):
        cfg.arch = "unregistered"  # a Config is checked once, when made: a changed one is replace(cfg, ...)
    with pytest.raises(m.ConfigError, match="unknown arch 'unregistered'"):
        m.replace(cfg, arch="unregistered")


def test_cli_bad_type_exits_2_without_traceback():
    out = subprocess.run([sys.executable, os.path.join(HERE, "mecheval.py"), "--d_model", "big"],
                         capture_output=True, text=True, cwd=HERE)
    assert out.returncode == 2
    assert "--d_model" in out.stderr and "big" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


TINY = ["--n_pairs", "3", "--n_keys", "10", "--n_values", "10", "--n_train", "200", "--n_eval", "50",
        "--d_model", "16", "--steps", "30", "--eval_every", "10"]
SMALL = TINY[:-6] + ["--steps", "30", "--eval_every", "10"]  # without --d_model, which a sweep sets


def test_cli_end_to_end_and_load_round_trip(tmp_path, capsys):
    assert m.main(TINY + ["--out_dir", str(tmp_path), "--run_name", "tiny"]) == 0
    run = tmp_path / "tiny"
    cfg = json.loads((run / "config.json").read_text())
    res = json.loads((run / "results.json").read_text())
    assert cfg["d_model"] == 16 and cfg["lr"] == m.DEFAULT_LR["attention"] and cfg["steps"] == 30
    assert res["status"] == "completed" and res["steps_done"] == 30 and len(res["history"]) == 3
    assert res["n_params"] > 0 and "final_acc" in res
    out = capsys.readouterr().out
    assert "step     10/30" in out and "ms/step" in out
    assert m.main(["--load", str(run)]) == 0
    assert f"eval acc {res['final_acc']:.4f}" in capsys.readouterr().out
    (run / "results.json").write_text(json.dumps({k: v for k, v in res.items() if k != "mechanism"}))
    assert m.main(["--load", str(run), "--analyze"]) == 0  # computes the grid again and writes it back
    assert "verdict:" in capsys.readouterr().out
    again = json.loads((run / "results.json").read_text())
    assert again["mechanism"]["grid"] == res["mechanism"]["grid"] and again["history"] == res["history"]
    assert m.main(["--load", str(run), "--corrupt", "value", "--analyze"]) == 0  # an analysis setting, not a training one
    assert "value corrupted" in capsys.readouterr().out  # printed; the run keeps its own grid
    assert json.loads((run / "results.json").read_text()) == again
    cfg2, model = m.load_run(str(run))
    assert m.evaluate(model, m.make_task(cfg2, train=False).eval)["acc"] == res["final_acc"]


def test_cli_load_refuses_mismatch(tmp_path, capsys):
    assert m.main(TINY + ["--out_dir", str(tmp_path), "--run_name", "tiny"]) == 0
    run = str(tmp_path / "tiny")
    capsys.readouterr()
    assert m.main(["--load", run, "--d_model", "32"]) == 2
    err = capsys.readouterr().err
    assert "d_model=16" in err and "d_model=32" in err
    for flag, value, words in (("--corrupt", "foo", "unknown corrupt 'foo'"), ("--device", "tpu", "unknown device 'tpu'"),
                               ("--n_eval", "-3", "n_eval must be a positive integer, not -3")):  # settings for --load
        assert m.main(["--load", run, flag, value, "--analyze"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and err.count("\n") == 1
    assert m.main(["--load", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    ckpt = torch.load(os.path.join(run, "model.pt"), weights_only=True)
    ckpt["config"]["d_model"] = 24  # a checkpoint whose weights do not fit its config (config.json says the same)
    torch.save(ckpt, os.path.join(run, "model.pt"))
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(ckpt["config"]))
    assert m.main(["--load", run]) == 2
    assert "results.json holds a run with d_model=16, not d_model=24; it holds files of two runs" in \
        capsys.readouterr().err
    results = json.loads((tmp_path / "tiny" / "results.json").read_text())
    (tmp_path / "tiny" / "results.json").write_text(json.dumps({**results, "config": ckpt["config"]}))
    assert m.main(["--load", run]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not fit" in err and "d_model=24" in err and "\n" not in err


def test_an_out_dir_that_cannot_be_created_is_refused_in_one_sentence(tmp_path, capsys):
    (tmp_path / "file").write_text("kept")
    assert m.main(TINY + ["--out_dir", str(tmp_path / "file" / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot create the run folder") and err.count("\n") == 1
    assert (tmp_path / "file").read_text() == "kept"


def test_run_folders_written_before_a_setting_existed_take_its_default(tmp_path):
    cfg = m.Config(**{**dict(n_pairs=3, n_keys=10, n_values=10, n_train=200, n_eval=50, d_model=16), "steps": 20,
                      "eval_every": 10, "target_acc": 0, "analyze": False, "out_dir": str(tmp_path)})
    m.train(cfg, log=lambda s: None)
    run = tmp_path / cfg.run_name
    old = json.loads((run / "config.json").read_text())
    del old["batch_order"]  # as written before --batch_order existed: those runs shuffled
    (run / "config.json").write_text(json.dumps(old))
    ckpt = torch.load(run / "model.pt", weights_only=True)
    ckpt["config"] = old
    torch.save(ckpt, run / "model.pt")
    loaded, _ = m.load_run(str(run))
    assert loaded.batch_order == "shuffle" and loaded.run_name == cfg.run_name
    m.same_settings(old, cfg, "run")  # so a sweep reuses it, and a rerun is not refused
    with pytest.raises(m.ConfigError, match=r"run holds a run with no batch_order \(the default, shuffle\), not batch_order=fixed"):
        m.same_settings(old, m.replace(cfg, batch_order="fixed"), "run")
    assert m.Run(cfg, log=lambda s: None).finished  # finished: nothing to resume, and no refusal


def test_batch_order_is_a_run_setting(tmp_path):
    cfg = small_ar(d_model=8, steps=20, eval_every=10, target_acc=0, analyze=False, out_dir=str(tmp_path))
    fixed = m.replace(cfg, batch_order="fixed", run_name="")
    assert fixed.run_name == cfg.run_name.replace("ar_", "ar_fixed_", 1)  # both orders can share a folder
    a, b = (m.train(c, log=lambda s: None) for c in (cfg, fixed))
    assert [h["loss"] for h in a["history"]] != [h["loss"] for h in b["history"]]
    with pytest.raises(m.ConfigError, match="batch_order=shuffle, not batch_order=fixed"):
        m.Run(m.replace(fixed, run_name=cfg.run_name), log=lambda s: None)  # a folder of the other order is refused
    with pytest.raises(m.ConfigError, match="unknown batch_order 'random'; allowed: shuffle, fixed"):
        m.replace(cfg, batch_order="random")


def test_beta2_and_positions_name_their_run_and_reach_the_optimiser(tmp_path):
    cfg = small_ar(d_model=8, steps=4, eval_every=1, target_acc=0, analyze=False, out_dir=str(tmp_path))
    other = m.replace(cfg, beta2=0.95, run_name="")
    assert m.replace(other, pos_emb="on", run_name="").run_name == cfg.run_name.replace("ar_", "ar_pos_on_b0.95_", 1)
    a, b = (m.train(c, log=lambda s: None) for c in (cfg, other))
    losses = [[h["loss"] for h in r["history"]] for r in (a, b)]
    assert losses[0][:2] == losses[1][:2] and losses[0][2:] != losses[1][2:]  # Adam's first step ignores beta2


def test_nan_loss_stops_with_message_and_keeps_files(tmp_path, capsys):
    argv = TINY + ["--lr", "1e30", "--out_dir", str(tmp_path), "--run_name", "nan"]
    assert m.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the training loss became") and "lr=1e+30" in err and "\n" not in err
    res = json.loads((tmp_path / "nan" / "results.json").read_text())
    assert res["status"] == "nonfinite" and (tmp_path / "nan" / "config.json").exists()


def folder_bytes(run):
    return {p.name: p.read_bytes() for p in sorted(run.iterdir())}


def cut_run(tmp_path, monkeypatch, name="cut", extra=()):
    """A run interrupted after its checkpoint at step 10 of 30: config.json, results.json, model.pt."""
    argv = TINY + ["--out_dir", str(tmp_path), "--run_name", name, "--no-analyze", *extra]
    fail_from_call(monkeypatch, 15, "interrupt")
    assert m.main(argv) == 130
    monkeypatch.undo()
    return argv, tmp_path / name


def test_a_finished_run_is_returned_not_trained_again(tmp_path, capsys):
    argv = TINY + ["--out_dir", str(tmp_path), "--run_name", "done", "--no-analyze"]
    assert m.main(argv) == 0
    before = folder_bytes(tmp_path / "done")
    capsys.readouterr()
    assert m.main(argv) == 0
    assert "finished (completed) at step 30; these are its results" in capsys.readouterr().out
    assert folder_bytes(tmp_path / "done") == before


def test_a_nan_stopped_run_says_how_to_go_on_and_keeps_its_files(tmp_path, capsys):
    argv = TINY + ["--lr", "1e30", "--out_dir", str(tmp_path), "--run_name", "nan"]
    assert m.main(argv) == 1
    before = folder_bytes(tmp_path / "nan")
    capsys.readouterr()
    assert m.main(argv) == 1
    err = capsys.readouterr().err
    assert "stopped on a non-finite loss" in err and "train another --lr" in err and err.count("\n") == 1
    assert folder_bytes(tmp_path / "nan") == before


def test_a_checkpoint_write_that_fails_half_way_keeps_the_last_good_one(tmp_path, capsys, monkeypatch):
    real, calls = torch.save, []

    def full_disk(obj, path):  # the second checkpoint: half a file, then the disk is full
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04 half")
            raise OSError(28, "No space left on device")
        return real(obj, path)
    monkeypatch.setattr(torch, "save", full_disk)
    argv = TINY + ["--out_dir", str(tmp_path), "--run_name", "full", "--no-analyze"]
    assert m.main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "model.pt (No space left on device)" in err and err.count("\n") == 1
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "full")) == ["config.json", "model.pt", "results.json"]  # no .tmp left
    assert torch.load(tmp_path / "full" / "model.pt", weights_only=True)["step"] == 10
    assert m.main(argv) == 0
    assert "from its checkpoint at step 10 of 30" in capsys.readouterr().out


@pytest.mark.parametrize("name, damage", [
    ("model.pt", lambda p: p.write_bytes(p.read_bytes()[:1000])),                                   # cut short
    ("model.pt", lambda p: torch.save(torch.load(p, weights_only=True)["model"], p)),             # a bare state_dict
    ("model.pt", lambda p: p.write_text("not a checkpoint")),
    ("results.json", lambda p: p.write_text("{garbage")), ("results.json", lambda p: p.write_text("null")),
    ("results.json", lambda p: p.write_text(p.read_text()[:50])),
    ("config.json", lambda p: p.write_text("[1, 2]")),
    ("config.json", lambda p: (p.unlink(), p.mkdir())),                                             # a folder
])
def test_a_damaged_or_foreign_file_is_refused_and_nothing_is_written(name, damage, tmp_path, capsys, monkeypatch):
    argv, run = cut_run(tmp_path, monkeypatch)
    damage(run / name)
    before = {p.name: p.is_dir() or p.read_bytes() for p in run.iterdir()}
    capsys.readouterr()
    for args in (argv, ["--load", str(run), "--analyze"]):
        assert m.main(args) == 2
        err = capsys.readouterr().err
        assert str(run / name) in err and "Traceback" not in err and err.count("\n") == 1, err
        assert {p.name: p.is_dir() or p.read_bytes() for p in run.iterdir()} == before


def test_a_checkpoint_of_other_settings_is_refused(tmp_path, capsys, monkeypatch):
    _, other = cut_run(tmp_path, monkeypatch, "other", ["--lr", "3e-3"])
    argv, run = cut_run(tmp_path, monkeypatch)
    (run / "model.pt").write_bytes((other / "model.pt").read_bytes())  # same shapes, another rate
    before = folder_bytes(run)
    capsys.readouterr()
    assert m.main(argv) == 2
    assert "model.pt holds a run with lr=0.003, not lr=0.001" in capsys.readouterr().err
    assert m.main(["--load", str(run), "--analyze"]) == 2  # its config.json says otherwise: not this run's model
    assert "config.json holds a run with lr=0.001, not lr=0.003" in capsys.readouterr().err
    assert folder_bytes(run) == before


def fail_from_call(monkeypatch, n, what):
    """Make train_step's n-th call (and later ones) raise KeyboardInterrupt, or return NaN after setting
    every weight to NaN, as a diverging step would."""
    real, calls = m.train_step, []

    def step(model, optimizer, *batch):
        calls.append(1)
        if len(calls) >= n and what == "interrupt":
            raise KeyboardInterrupt
        loss = real(model, optimizer, *batch)
        if len(calls) >= n:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
            return loss * float("nan")
        return loss
    monkeypatch.setattr(m, "train_step", step)
    return calls


def test_nan_after_a_checkpoint_stops_and_keeps_that_checkpoint(tmp_path, capsys, monkeypatch):
    fail_from_call(monkeypatch, 15, "nan")
    assert m.main(TINY + ["--out_dir", str(tmp_path), "--run_name", "nan"]) == 1  # evaluations at 10, 20, 30
    err = capsys.readouterr().err.strip()
    assert "between steps 11 and 20" in err and "model.pt keeps the checkpoint of step 10" in err and "\n" not in err
    monkeypatch.undo()
    res = json.loads((tmp_path / "nan" / "results.json").read_text())
    assert res["status"] == "nonfinite" and res["steps_done"] == 10 and [h["step"] for h in res["history"]] == [10]
    ckpt = torch.load(tmp_path / "nan" / "model.pt", weights_only=True)
    assert ckpt["step"] == 10 and all(torch.isfinite(v).all() for v in ckpt["model"].values())
    cfg, model = m.load_run(str(tmp_path / "nan"))
    assert m.evaluate(model, m.make_task(cfg, train=False).eval)["acc"] == res["history"][0]["acc"]


def test_ctrl_c_exits_130_and_the_same_command_continues(tmp_path, capsys, monkeypatch):
    argv = TINY + ["--out_dir", str(tmp_path), "--run_name", "cut", "--no-analyze"]
    fail_from_call(monkeypatch, 15, "interrupt")
    assert m.main(argv) == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted; saved files are kept; the same command resumes") and err.count("\n") == 1
    assert torch.load(tmp_path / "cut" / "model.pt", weights_only=True)["step"] == 10
    monkeypatch.undo()
    before = (tmp_path / "cut" / "results.json").read_bytes()  # a grid of the checkpoint would be lost on resume
    assert m.main(["--load", str(tmp_path / "cut"), "--analyze"]) == 2
    assert "is unfinished (running): its training command finishes it" in capsys.readouterr().err
    assert (tmp_path / "cut" / "results.json").read_bytes() == before
    assert m.main(argv) == 0
    assert f"resuming {tmp_path / 'cut'} from its checkpoint at step 10 of 30" in capsys.readouterr().out
    assert json.loads((tmp_path / "cut" / "results.json").read_text())["steps_done"] == 30


ATR_TINY = ["--task", "atr", "--n_train", "300", "--n_eval", "50", "--d_model", "16", "--steps", "30", "--eval_every", "10"]


@pytest.mark.parametrize("argv", [TINY, ATR_TINY + ["--atr_split", "gen"]], ids=["ar", "gen"])
def test_an_interrupt_inside_the_final_grid_leaves_a_run_the_same_command_finishes(argv, tmp_path, capsys,
                                                                                     monkeypatch):
    """Cut inside the final grid, after the done line, the run is "trained", not finished: the same command adds
    the grid (and the test split's numbers), trains nothing again, and equals a run that was never cut."""
    argv = argv + ["--out_dir", str(tmp_path), "--analyze_every", "20"]
    assert m.main(argv + ["--run_name", "whole"]) == 0
    real = m.mechanism

    def cut_in_the_grid(*args, **kw):  # the checks while training run; the final grid is cut
        if kw.get("cells") is None and len(args) < 6:
            raise KeyboardInterrupt
        return real(*args, **kw)
    monkeypatch.setattr(m, "mechanism", cut_in_the_grid)
    assert m.main(argv + ["--run_name", "cut"]) == 130
    assert "done (" in capsys.readouterr().out
    saved = json.loads((tmp_path / "cut" / "results.json").read_text())
    assert saved["status"] == "trained" and "mechanism" not in saved and "test_acc" not in saved
    monkeypatch.undo()
    assert m.main(argv + ["--run_name", "cut"]) == 0
    out = capsys.readouterr().out
    assert "from its final weights at step 30 of 30" in out and "\nstep " not in out, "nothing is trained again"
    a, b = (json.loads((tmp_path / r / "results.json").read_text()) for r in ("whole", "cut"))
    assert b["status"] == a["status"] == "completed" and a.keys() == b.keys()
    for k in set(a) - {"train_seconds", "ms_per_step", "config"}:
        grid = lambda r: {**r[k], "seconds": 0} if k.startswith("mechanism") else r[k]
        assert grid(a) == grid(b), k
    assert m.main(argv + ["--run_name", "cut"]) == 0 and "finished (completed)" in capsys.readouterr().out
    weights = (tmp_path / "cut" / "model.pt").read_bytes()
    (tmp_path / "cut" / "model.pt").unlink()  # a trained run without its weights trains them again, the same
    (tmp_path / "cut" / "results.json").write_text(json.dumps({**b, "status": "trained"}))
    assert m.main(argv + ["--run_name", "cut"]) == 0 and "done (completed)" in capsys.readouterr().out
    saved = lambda: torch.load(tmp_path / "cut" / "model.pt", weights_only=True)["model"]
    assert all(torch.equal(v, torch.load(io.BytesIO(weights), weights_only=True)["model"][k]) for k, v in saved().items())


def test_a_file_of_another_run_or_tool_is_refused_and_kept_and_the_next_command_resumes(tmp_path, capsys,
                                                                                      monkeypatch):
    """results.json of another tool or run, a status this tool never writes, a file missing before one written
    after it: one sentence and nothing changed, by training and by --load; put back, the same command resumes. A
    key the user added to config.json stays."""
    argv, run = cut_run(tmp_path, monkeypatch)
    ours, _ = (run / "results.json").read_text(), capsys.readouterr()
    for text, words in (('{"config": {}, "note": "my notes"}', "results.json is not a file this tool wrote or can "
                                                                 "read (no 'status')"),
                        ('{"config": {}, "status": "completed", "steps_done": 30}', "results.json holds a run with "
                         "no n_pairs (the default, 16), not n_pairs=3"),
                        ('{"config": {}, "status": "done", "steps_done": 3}', "(status 'done')"),
                        ('{"config": {}, "status": "completed"}', "(no 'steps_done')")):
        (run / "results.json").write_text(text)
        before = folder_bytes(run)
        for args in (argv, ["--load", str(run)]):
            assert m.main(args) == 2
            err = capsys.readouterr().err
            assert words in err and err.count("\n") == 1 and "step None" not in err, err
            assert folder_bytes(run) == before
    (run / "results.json").unlink()  # removed by hand: the tool's own files are named, not called foreign
    assert m.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{run} holds config.json and model.pt but no results.json, written before them" in err
    before = folder_bytes(run)
    assert m.main(["--load", str(run), "--analyze"]) == 0 and folder_bytes(run) == before  # printed, not written
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").unlink()
    (run / "results.json").write_text(ours)
    assert m.main(argv) == 2 and "holds results.json and model.pt but no config.json" in capsys.readouterr().err
    (run / "config.json").write_text(json.dumps({**config, "note": "my notes"}))  # put back, with the user's key
    assert m.main(argv) == 0 and "from its checkpoint at step 10 of 30" in capsys.readouterr().out
    assert json.loads((run / "config.json").read_text())["note"] == "my notes"
    assert json.loads((run / "results.json").read_text())["status"] == "completed"


def test_every_flag_is_honoured_or_refused_in_one_true_sentence(tmp_path, capsys):
    """--load takes only the settings it uses; --lr 0 means the default there too; --seed beside --seeds, a
    grid naming one folder twice, a file that cannot be written, sizes past any memory: one sentence, no
    traceback, nothing written."""
    argv = TINY + ["--out_dir", str(tmp_path), "--run_name", "r", "--no-analyze"]
    assert m.main(argv) == 0
    run, _ = str(tmp_path / "r"), capsys.readouterr()
    before = folder_bytes(tmp_path / "r")
    for extra, words in ((["--corrupt", "value"], "--corrupt applies to the grid"),
                         (["--out_dir", str(tmp_path / "x")], "was trained with out_dir="),
                         (["--compile"], "was trained with compile=False, not compile=True; drop --compile"),
                         (["--lr", "3e-3"], "was trained with lr=0.001, not lr=0.003"),
                         (["--steps", "0"], "was trained with steps=30, not steps=50016")):
        assert m.main(["--load", run, *extra]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    assert m.main(["--load", run, "--lr", "0"]) == 0 and m.main(["--load", run, "--lr", "1e-3"]) == 0  # the same
    assert folder_bytes(tmp_path / "r") == before
    capsys.readouterr()
    for extra, words in ((["--sweep", "--widths", "8", "--seed", "5", "--seeds", "0"], "leave out --seed"),
                         (["--sweep", "--widths", "8", "--lrs", "0.001,0.0010000001"], "a name keeps 6 digits of lr"),
                         (["--analyze_every", "15"], "analyze_every=15 is not a multiple of eval_every=10"),
                         (["--d_model", str(2 ** 64)], f"d_model={2 ** 64} is out of range"),
                         (["--sweep", "--widths", str(2 ** 64)], f"d_model={2 ** 64} is out of range"),
                         (["--n_train", str(2 ** 63)], "below 2**63"), (["--n_eval", str(2 ** 70)], "below 2**63"),
                         (["--run_name", "a\0b"], "holds a NUL byte"),
                         (["--d_model", str(2 ** 62)], "does not fit in memory"),
                         (["--n_eval", str(2 ** 50)], "does not fit in memory")):
        out = str(tmp_path / "new")
        assert m.main(TINY[:-6] + ["--steps", "30", "--eval_every", "10", *extra, "--out_dir", out]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and err.count("\n") == 1, err
        assert not os.path.exists(out) or not os.listdir(out) or extra[-1] == str(2 ** 50)
    assert m.main(["--load", run, "--n_eval", str(2 ** 50)]) == 2
    assert "does not fit in memory" in (err := capsys.readouterr().err) and "give a smaller n_eval" in err
    os.makedirs(tmp_path / "t" / "r" / "results.json.tmp")  # results.json cannot be written, and never was
    assert m.main(TINY + ["--out_dir", str(tmp_path / "t"), "--run_name", "r"]) == 2
    assert "results.json (Is a directory); nothing was written" in capsys.readouterr().err
    os.makedirs(tmp_path / "s" / "summary.md")  # a summary that is a folder
    assert m.main(SMALL + ["--sweep", "--widths", "8", "--lrs", "1e-3", "--out_dir", str(tmp_path / "s")]) == 2
    assert "holds another summary" in capsys.readouterr().err


def test_a_checkpoint_with_a_state_that_does_not_fit_is_refused_and_kept(tmp_path, capsys, monkeypatch):
    argv, run = cut_run(tmp_path, monkeypatch)
    ckpt, _ = torch.load(run / "model.pt", weights_only=True), capsys.readouterr()
    for name in ("optimizer", "scheduler"):
        torch.save({**ckpt, name: {}}, run / "model.pt")
        before = folder_bytes(run)
        assert m.main(argv) == 2
        err = capsys.readouterr().err
        assert f"model.pt holds a {name} state that does not fit" in err and err.count("\n") == 1, err
        assert folder_bytes(run) == before
    torch.save(ckpt, run / "model.pt")
    assert m.main(argv) == 0 and "from its checkpoint at step 10 of 30" in capsys.readouterr().out


def test_a_sweep_cut_inside_a_grid_is_finished_and_summarised_by_the_same_command(tmp_path, capsys, monkeypatch):
    """The sweep's second run is cut inside its final grid: the same command finishes that run (training nothing
    again), trains the rest and writes the summary a sweep never cut writes."""
    argv = lambda out: SMALL + ["--steps", "20", "--sweep", "--widths", "8", "--lrs", "1e-3,3e-3", "--out_dir",
                                str(tmp_path / out)]
    assert m.main(argv("whole")) == 0
    real, calls = m.mechanism, []

    def cut_second_grid(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)
    monkeypatch.setattr(m, "mechanism", cut_second_grid)
    assert m.main(argv("cut")) == 130
    assert not (tmp_path / "cut" / "summary.json").exists()
    monkeypatch.setattr(m, "mechanism", real)
    monkeypatch.setattr(m, "train_step", lambda *a, **k: pytest.fail("a trained run was trained again"))
    assert m.main(argv("cut")) == 0
    capsys.readouterr()
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "cut"))
    drop = lambda rows: [{k: v for k, v in r.items() if k != "train_seconds"} for r in rows]
    assert drop(a["rows"]) == drop(b["rows"]) and a["runs"] == b["runs"]
    assert (tmp_path / "cut" / "summary.md").read_text() == (tmp_path / "whole" / "summary.md").read_text()


def test_a_checkpoint_is_kept_only_where_the_evaluation_is_finite(tmp_path, capsys, monkeypatch):
    """The loss of step 15 is finite, but its update leaves NaN weights: the evaluation at 20 is NaN, so the run
    stops there and keeps the checkpoint of step 10; a grid of NaN weights is refused."""
    real = m.train_step
    calls = []

    def step(model, *args, **kw):
        calls.append(1)
        loss = real(model, *args, **kw)
        if len(calls) == 15:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
        return loss
    monkeypatch.setattr(m, "train_step", step)
    assert m.main(TINY + ["--out_dir", str(tmp_path), "--run_name", "nan"]) == 1
    err = capsys.readouterr().err
    assert "p(answer) nan, between steps 11 and 20" in err and "keeps the checkpoint of step 10" in err
    assert torch.load(tmp_path / "nan" / "model.pt", weights_only=True)["step"] == 10
    cfg, model = m.load_run(str(tmp_path / "nan"))
    next(model.parameters()).data.fill_(float("nan"))
    with pytest.raises(ValueError, match="^p\\(answer\\) is not finite on this split: the model holds NaN or inf$"):
        m.mechanism(model, m.make_task(cfg, train=False))


@pytest.mark.parametrize("arch, order", [("mamba", "shuffle"), ("attention", "fixed")])
def test_interrupted_run_resumes_on_the_same_trajectory(arch, order, tmp_path, capsys):
    cfg = small_atr(arch=arch, d_model=16, steps=60, eval_every=10, analyze_every=20, target_acc=0, analyze=False,
                    out_dir=str(tmp_path), run_name="whole", batch_order=order)
    whole = m.train(cfg, log=lambda s: None)

    def stop_at_30(line):  # the progress line of step 30 comes after its checkpoint: resume from step 30
        if line.startswith("step     30"):
            raise KeyboardInterrupt
    cut = m.replace(cfg, run_name="cut")
    with pytest.raises(KeyboardInterrupt):
        m.train(cut, log=stop_at_30)
    assert torch.load(tmp_path / "cut" / "model.pt", weights_only=True)["results"]["steps_done"] == 30
    lines = []
    resumed = m.train(m.replace(cfg, run_name="cut"), log=lines.append)
    assert [l for l in lines if l.startswith("resuming")] == [f"resuming {tmp_path / 'cut'} from its checkpoint at step 30 of 60"]
    assert resumed["history"] == whole["history"] and resumed["status"] == "completed"  # the checks at 20, 40, 60 too
    assert [h["step"] for h in resumed["history"] if "verdict" in h] == [20, 40, 60]
    a, b = (torch.load(tmp_path / r / "model.pt", weights_only=True) for r in ("whole", "cut"))
    assert "optimizer" not in b and a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])  # bit for bit on a CPU
    # a run folder of other settings is refused, and what it holds stays as it was
    before = (tmp_path / "cut" / "results.json").read_text()
    argv = ["--task", "atr", "--arch", arch, "--out_dir", str(tmp_path), "--run_name", "cut", "--steps", "5"]
    assert m.main(argv) == 2
    err = capsys.readouterr().err
    assert "holds a run with n_train=300, not n_train=100032" in err and err.count("\n") == 1
    assert (tmp_path / "cut" / "results.json").read_text() == before


@pytest.mark.parametrize("cuda, mps, want", [(True, True, "cuda"), (False, True, "mps"), (False, False, "cpu")])
def test_device_auto_prefers_cuda_then_mps_then_cpu(cuda, mps, want, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert m.setup(m.Config(device="auto")) == want
    if not cuda:
        with pytest.raises(m.ConfigError, match="device 'cuda' is not available here"):
            m.setup(m.Config(device="cuda"))


# -------------------------------------------------------------------------------- kernels and mixers

import kernels  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.flop_counter  # noqa: E402


def _inputs(op, B, L, d, gen):
    """Random inputs of kernel op (its reference and fast forms take the same) at batch B, length L, width d."""
    r, E = (lambda *s: torch.randn(*s, generator=gen)), 2 * d
    op = op.replace("_parallel", "")  # the scan's two fast forms take the same inputs
    return {"short_conv": lambda: [r(B, L, E), r(E, 4), r(E)], "long_conv": lambda: [r(B, L, d), r(d, L) * 0.1],
            "based_attention": lambda: [r(B, L, 8), r(B, L, 8), r(B, L, d)],
            "selective_scan": lambda: [r(B, L, E), F.softplus(r(B, L, E)), -torch.rand(E, 16, generator=gen) * 4,
                                       r(B, L, 16), r(B, L, 16), r(E)],
            "delta_rule": lambda: [F.normalize(r(B, L, d), dim=-1), F.normalize(r(B, L, d), dim=-1), r(B, L, d),
                                   torch.rand(B, L, generator=gen)]}[op]()


PAIRS = {"short_conv": (kernels.short_conv_ref, kernels.short_conv), "long_conv": (kernels.long_conv_ref, kernels.long_conv),
         "based_attention": (kernels.based_attention_ref, kernels.based_attention),
         "selective_scan": (kernels.selective_scan_ref, kernels.selective_scan),
         "selective_scan_parallel": (kernels.selective_scan_ref, kernels.selective_scan_parallel),
         "delta_rule": (kernels.delta_rule_ref, kernels.delta_rule)}  # op -> (reference, fast form)


def check_pair(ref, fast, args, rtol=1e-4, atol=1e-5, dtypes=(torch.float64, torch.float32), **kw):
    """fast equals ref on the output and on every input gradient (one random upstream gradient). In float64
    entry by entry (the same arithmetic in another order agrees to ~1e-12); in float32, the form the models
    run, to the rounding that each tensor's magnitude allows (a sum of large terms loses small entries)."""
    gy = None
    for dtype in dtypes:
        xs = [a.detach().to(dtype if a.is_floating_point() else a.dtype).requires_grad_(a.is_floating_point())
              for a in args]
        y_ref = ref(*xs, **kw)
        gy = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype)
        unused = dict(allow_unused=True, materialize_grads=True)  # an input a form does not use has gradient 0
        g_ref = torch.autograd.grad(y_ref, xs, gy, **unused)
        y_fast = fast(*xs, **kw)
        g_fast = torch.autograd.grad(y_fast, xs, gy, **unused)
        if dtype == torch.float64:
            tol = dict(rtol=1e-7, atol=1e-9)
            torch.testing.assert_close(y_fast, y_ref, **tol, msg="output, float64")
            for i, (a, b) in enumerate(zip(g_fast, g_ref)):
                torch.testing.assert_close(a, b, **tol, msg=f"gradient of input {i}, float64")
        else:
            scale = lambda t: atol * max(1.0, t.abs().max().item())
            torch.testing.assert_close(y_fast, y_ref, rtol=rtol, atol=scale(y_ref), msg="output")
            for i, (a, b) in enumerate(zip(g_fast, g_ref)):
                torch.testing.assert_close(a, b, rtol=rtol, atol=scale(b), msg=f"gradient of input {i}")


@pytest.mark.parametrize("op", sorted(PAIRS))
@pytest.mark.parametrize("L", [1, 7, 37, 65, 200])
def test_kernel_fast_equals_reference(op, L):
    ref, fast = PAIRS[op]
    args = _inputs(op, 3, L, 16, torch.Generator().manual_seed(L))
    check_pair(ref, fast, args)


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_delta_rule_chunk_sizes_and_extreme_betas(chunk):
    gen = torch.Generator().manual_seed(chunk)
    q, k, v, _ = _inputs("delta_rule", 2, 37, 8, gen)
    for beta in (torch.full((2, 37), 1e-4), torch.full((2, 37), 1 - 1e-4), torch.rand(2, 37, generator=gen)):
        check_pair(kernels.delta_rule_ref, lambda *a: kernels.delta_rule(*a, chunk=chunk), [q, k, v, beta])


def test_hand_written_backward_passes_gradcheck():
    """The Toeplitz convolution's written-out backward against finite differences, float64, tiny shapes."""
    gen = torch.Generator().manual_seed(0)
    u, h = torch.randn(2, 6, 3, generator=gen, dtype=torch.float64), torch.randn(3, 8, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(kernels._ToeplitzConv.apply, (u.requires_grad_(), h.requires_grad_()))


@pytest.mark.parametrize("fast", [kernels.selective_scan, kernels.selective_scan_parallel])
def test_selective_scan_large_delta(fast):
    x, delta, A, B, C, D = _inputs("selective_scan", 2, 37, 8, torch.Generator().manual_seed(0))
    check_pair(kernels.selective_scan_ref, fast, [x, delta * 50 + 5, A, B, C, D])  # exp(ΔA) underflows to 0


def aten_ops(fn, args):
    """How many ATen ops that compute (views and detach left out, as they launch nothing) fn's forward and
    backward runs, counted at the dispatcher."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            returns = func._schema.returns
            Count.n += not (returns and returns[0].alias_info is not None)
            return func(*args, **(kwargs or {}))
    xs = [a.detach().requires_grad_() for a in args]
    with Count():
        fn(*xs).sum().backward()
    return Count.n


def test_parallel_scan_launches_few_ops_that_grow_with_log_length():
    gen = torch.Generator().manual_seed(0)
    at = lambda fn, L: aten_ops(fn, _inputs("selective_scan", 32, L, 64, gen))  # (B, L, E, N) = (32, L, 128, 16)
    loop, parallel = at(kernels.selective_scan, 37), at(kernels.selective_scan_parallel, 37)
    assert parallel <= 150 < 700 < loop, (parallel, loop)
    assert at(kernels.selective_scan_parallel, 74) - parallel <= 20 < at(kernels.selective_scan, 74) - loop  # one round: 16


def test_loop_free_kernels_compile_with_fullgraph():
    """The scan and the chunked delta rule trace whole (no graph break), and compiled equal their references."""
    gen = torch.Generator().manual_seed(0)
    torch._dynamo.reset()
    for op in ("selective_scan_parallel", "delta_rule"):
        ref, fast = PAIRS[op]
        check_pair(ref, torch.compile(fast, fullgraph=True), _inputs(op, 2, 9, 8, gen), dtypes=(torch.float32,))


def test_long_conv_is_causal_and_cuts_long_filters():
    gen = torch.Generator().manual_seed(0)
    for L in (20, 128, 130):  # the Toeplitz matmul up to 128, the FFT beyond; a filter longer than L
        check_pair(kernels.long_conv_ref, kernels.long_conv, [torch.randn(2, L, 3, generator=gen),
                                                              torch.randn(3, L + 44, generator=gen)])
    u, h = torch.randn(2, 20, 3, generator=gen), torch.randn(3, 64, generator=gen)
    y = kernels.long_conv(u, h)
    u2 = u.clone()
    u2[:, 12] += 1
    assert (kernels.long_conv(u2, h)[:, :12] - y[:, :12]).abs().max() < 1e-5


MIXER_PARAMS = {  # the paper's models at d=64: per-layer mixer parameters, and all blocks together
    ("attention", "auto"): ([16_448, 16_448], 99_584), ("based", "auto"): ([4_416, 9_216], 80_320),
    ("based", "long"): ([8_384, 9_216], 84_288), ("base_conv", "auto"): ([4_416, 8_384], 79_488),
    ("base_conv", "long"): ([8_384, 8_384], 83_456), ("hyena", "auto"): ([33_280, 33_280], 133_248),
    ("h3", "auto"): ([246_144, 246_144], 558_976), ("mamba", "auto"): ([32_640, 32_640], 65_408),
    ("mamba", "3"): ([32_512] * 2, None), ("mamba", "2"): ([32_384] * 2, None), ("mamba", "1"): ([32_256] * 2, None),
    ("mamba", "0"): ([32_640] * 2, None),  # the unused width-4 conv is still built, as in tinylang
    ("deltanet", "auto"): ([17_280, 17_280], None),  # fla's DeltaNet with one head
}


@pytest.mark.parametrize("arch, d_conv", sorted(MIXER_PARAMS))
def test_mixer_parameter_counts_match_the_paper(arch, d_conv):
    model = m.build_model(m.Config(arch=arch, d_conv=d_conv), 8196)
    mixers, blocks = MIXER_PARAMS[arch, d_conv]
    assert [sum(p.numel() for p in b.mixer.parameters()) for b in model.blocks] == mixers
    if blocks:
        assert sum(p.numel() for p in model.blocks.parameters()) == blocks


@pytest.mark.parametrize("arch", sorted(m.ARCHS))
def test_every_architecture_is_strictly_causal(arch):
    """Changing token t leaves every earlier logit bit for bit the same: each mixer reads only the past, so
    nothing even rounds differently (at L <= 128 the long convolutions are Toeplitz matmuls). Weights larger
    than the init, so that a leak could not hide in the rounding."""
    _, model = tiny_model(arch)
    ids = torch.randint(3, 53, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
        for t in (0, 9, 22):
            ids2 = ids.clone()
            ids2[:, t] = (ids2[:, t] - 3 + 1) % 50 + 3
            logits2 = model(ids2)
            assert torch.equal(logits2[:, :t], logits[:, :t]), f"{arch}: token {t} moved earlier logits"
            assert (logits2[:, t] - logits[:, t]).abs().max() > 1e-3, f"{arch}: token {t} has no effect"


@pytest.mark.parametrize("arch", ["base_conv", "hyena", "h3"])
def test_long_convolutions_are_causal_on_the_fft_path(arch):
    """Past L=128 a long convolution runs as an FFT of size 2L, whose rounding spreads over all positions:
    earlier logits move only at the rounding level (a circular FFT would leak ~1e-2 here)."""
    _, model = tiny_model(arch)
    ids = torch.randint(3, 53, (2, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
        ids[:, 100] = (ids[:, 100] - 3 + 1) % 50 + 3
        moved = (model(ids) - logits).abs().amax(dim=(0, 2))        # (L,)
    assert moved[:100].max() < 1e-5 * logits.abs().max() and moved[100] > 1e-3, (moved[:100].max(), moved[100])


def loss_falls(cfg, tmp_path):
    res = m.train(m.Config(**{**dict(d_model=32, steps=200, eval_every=50, target_acc=0, analyze=False, lr=3e-3,
                                     out_dir=str(tmp_path), n_eval=64), **cfg}), log=lambda s: None)
    losses = [h["loss"] for h in res["history"]]  # mean training loss of each 50-step interval
    assert all(a > b for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.3, f"{cfg}: {losses}"
    return res


def learns_ar(cfg, tmp_path):
    """Learning on a small AR (2 pairs, 16 values), not only the answer's class: a model that learned just that
    the answer is some value ends at loss ln 16 = 2.77 and 1/16 accuracy (so does one whose mixer output is
    zeroed). Each architecture here ends at loss <= 2.21 and accuracy >= 0.22 (measured, seed 0)."""
    res = loss_falls(dict(n_pairs=2, n_keys=16, n_values=16, n_train=2000, lr=1e-2, **cfg), tmp_path)
    assert res["history"][-1]["loss"] < math.log(16) - 0.4 and res["final_acc"] >= 2 / 16, (cfg, res["history"])


@pytest.mark.parametrize("arch", sorted(m.ARCHS))
def test_every_architecture_learns_small_ar_and_atr(arch, tmp_path):
    learns_ar(dict(arch=arch), tmp_path)
    loss_falls(dict(arch=arch, task="atr", n_train=2000), tmp_path)


ABLATIONS = [("mamba", w) for w in ["0", "1", "2", "3", "4", "8"]] + [("based", w) for w in ["1", "2", "3", "4", "long"]]


@pytest.mark.parametrize("arch, d_conv", ABLATIONS)
def test_conv_width_ablations_set_the_receptive_field(arch, d_conv):
    """--d_conv K: a change of token 4 reaches layer 0's conv_output at positions 4 .. 4+K-1 and no further;
    0 (Mamba) leaves no short convolution; long (Based) reaches every later position of the mixer's output."""
    cfg = m.replace(small_ar(n_eval=6), arch=arch, d_conv=d_conv, d_model=16, run_name="")
    model = m.build_model(cfg, 53)
    ids = torch.randint(3, 53, (2, 12), generator=torch.Generator().manual_seed(0))
    ids2 = ids.clone()
    ids2[:, 4] = (ids2[:, 4] - 3 + 1) % 50 + 3
    site = ("conv_output", 0) if d_conv not in ("0", "long") else ("mixer_output", 0)
    assert (("conv_output", 0) in m.model_sites(model)) == (site[0] == "conv_output")
    acts = []
    with torch.no_grad(), m.hooks(model, {site: acts.append}):
        assert torch.isfinite(model(ids)).all()
        model(ids2)
    moved = ((acts[0] - acts[1]).abs().amax(dim=(0, 2)) > 0).tolist()  # (L,) which positions the change reached
    reach = 12 if d_conv in ("0", "long") else 4 + int(d_conv)  # Mamba without a conv: its scan reaches all
    assert moved == [4 <= t < reach for t in range(12)]


def test_a_conv_width_ablation_trains(tmp_path):
    learns_ar(dict(arch="mamba", d_conv="2"), tmp_path)


@pytest.mark.parametrize("argv, words", [
    (["--arch", "hyena", "--d_conv", "3"], ["d_conv", "arch=hyena"]),
    (["--arch", "mamba", "--d_conv", "1025"], ["d_conv=1025", "0 to 1024"]),
    (["--arch", "deltanet", "--d_conv", "long"], ["d_conv=long", "0 to 1024"]),
    (["--arch", "mamba", "--d_conv", ""], ["d_conv= ", "0 to 1024"]),
    (["--arch", "based", "--d_conv", "0"], ["d_conv=0", "long"]),
])
def test_invalid_conv_widths_are_rejected(argv, words, capsys, tmp_path):
    assert m.main(argv + ["--out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words) and err.count("\n") == 1


# ------------------------------------------------------------------------------------------- sweeps

def test_sweep_selects_the_best_rate_per_width_and_summarises(tmp_path):
    base = m.Config(n_pairs=3, n_keys=10, n_values=10, n_train=300, n_eval=40, steps=30, eval_every=15,
                    target_acc=0, out_dir=str(tmp_path))
    summary = m.sweep(base, widths=(8, 16), lrs=(1e-4, 3e-2), log=lambda s: None)
    assert [r["d_model"] for r in summary["rows"]] == [8, 16]
    for row in summary["rows"]:  # each run's own results.json decides, independently of the summary code
        runs = {lr: json.loads((tmp_path / f"ar_attention_d{row['d_model']}_l2_lr{lr:g}_s0" / "results.json").read_text())
                for lr in (1e-4, 3e-2)}
        best = max(runs, key=lambda lr: (runs[lr]["final_acc"], runs[lr]["final_p_answer"]))
        assert row["best_lr"] == best and row["acc"] == 100 * runs[best]["final_acc"]
        assert {lr: s["acc"] for lr, s in row["acc_by_lr"].items()} == {f"{lr:g}": 100 * r["final_acc"]
                                                                         for lr, r in runs.items()}
        value = next(g["attribution"] for g in runs[best]["mechanism"]["grid"]
                     if (g["site"], g["layer"], g["position"]) == ("block_input", 1, "value"))
        assert row["attribution"]["value"] == value
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert "| 16 |" in (tmp_path / "summary.md").read_text()


def test_sweep_resumes_a_run_cut_mid_way_and_reuses_finished_ones(tmp_path, monkeypatch):
    base = m.Config(n_pairs=3, n_keys=10, n_values=10, n_train=300, n_eval=40, steps=30, eval_every=10,
                    target_acc=0, analyze=False)
    grid = dict(widths=(8,), lrs=(1e-3, 3e-3), log=lambda s: None)
    whole = m.sweep(m.replace(base, out_dir=str(tmp_path / "whole")), **grid)
    fail_from_call(monkeypatch, 45, "interrupt")  # the second run, at its step 15: its checkpoint is step 10's
    with pytest.raises(KeyboardInterrupt):
        m.sweep(m.replace(base, out_dir=str(tmp_path / "cut")), **grid)
    monkeypatch.undo()
    calls = fail_from_call(monkeypatch, 10 ** 9, "interrupt")  # counts steps only
    again = m.sweep(m.replace(base, out_dir=str(tmp_path / "cut")), **grid)
    assert len(calls) == 20, "the cut run trains its steps 11-30 only; the finished run is reused"
    drop = lambda rows: [{k: v for k, v in r.items() if k != "train_seconds"} for r in rows]
    assert drop(again["rows"]) == drop(whole["rows"])
    histories = [json.loads((tmp_path / d / "ar_attention_d8_l2_lr0.003_s0" / "results.json").read_text())["history"]
                 for d in ("whole", "cut")]
    assert [h["loss"] for h in histories[0]] == [h["loss"] for h in histories[1]]  # the same trajectory
    calls.clear()  # the same folder spelled another way (relative vs absolute) is the same sweep
    m.sweep(m.replace(base, out_dir=os.path.relpath(str(tmp_path / "cut"))), **grid)
    m.sweep(m.replace(base, out_dir=str(tmp_path / "cut"), compile=True), **grid)  # as a job array's summary
    assert calls == []


def test_a_nan_run_in_a_sweep_is_a_finished_result(tmp_path, monkeypatch):
    base = m.Config(n_pairs=3, n_keys=10, n_values=10, n_train=300, n_eval=40, steps=20, eval_every=10,
                    target_acc=0, analyze=False, out_dir=str(tmp_path))
    summary = m.sweep(base, widths=(8,), lrs=(1e-3, 1e30), log=lambda s: None)
    nan = json.loads((tmp_path / "ar_attention_d8_l2_lr1e+30_s0" / "results.json").read_text())
    assert nan["status"] == "nonfinite" and summary["rows"][0]["best_lr"] == 1e-3
    assert summary["rows"][0]["acc_by_lr"]["1e+30"]["acc"] == 100 * nan.get("final_acc", 0.0)
    calls = fail_from_call(monkeypatch, 10 ** 9, "interrupt")
    m.sweep(base, widths=(8,), lrs=(1e-3, 1e30), log=lambda s: None)
    assert calls == [], "a NaN run is not trained again"


def test_sweep_cli_and_paper_grids(tmp_path, capsys):
    assert m.paper_lrs("ar", "attention") == (3e-5, 1e-4, 3e-4, 1e-3, 3e-3)
    assert m.paper_lrs("ar", "mamba")[-2:] == (1e-2, 3e-2) and len(m.paper_lrs("atr", "mamba")) == 5
    assert m.main(["--lrs", "1e-3"]) == 2 and "add --sweep" in capsys.readouterr().err
    argv = SMALL + ["--sweep", "--widths", "8", "--lrs", "1e-3,3e-3", "--out_dir", str(tmp_path)]
    assert m.main(argv) == 0
    assert "best learning rate per width" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "summary.json").read_text())["rows"]) == 1
    argv = SMALL + ["--arch", "based", "--sweep", "--widths", "8", "--lrs", "0", "--out_dir", str(tmp_path / "default")]
    assert m.main(argv) == 0  # lr 0 = the architecture's measured default
    assert json.loads((tmp_path / "default" / "summary.json").read_text())["rows"][0]["best_lr"] == m.DEFAULT_LR["based"]
    assert m.main(SMALL + ["--sweep", "--lrs", "1e-3,-1", "--out_dir", str(tmp_path)]) == 2  # checked as the lr it becomes
    assert capsys.readouterr().err == "error: lr must be a positive number (or 0 for the default), not -1.0\n"
    with pytest.raises(SystemExit) as e:  # argparse errors exit 2 with one line
        m.main(SMALL + ["--sweep", "--widths", "8,x"])
    assert e.value.code == 2 and "invalid comma-separated int list value: '8,x'" in capsys.readouterr().err


@pytest.mark.parametrize("L", [1, 7, 40, 200])
def test_h3_ssm_kernel_matches_the_complex_formula(L):
    h3 = m.H3(m.Config(arch="h3", d_model=8), 0).double()
    with torch.no_grad():
        h3.inv_A_real.uniform_(-2, 1)
        h3.log_dt.uniform_(-5, -1)
    params = [h3.log_dt, h3.inv_A_real, h3.A_imag, h3.B, h3.C]
    want = kernels.ssm_kernel_ref(h3.log_dt.exp(), -h3.inv_A_real.exp(), h3.A_imag, h3.B, h3.C, L)
    with torch.no_grad():  # independently: the impulse response of the bilinear (Tustin) discretisation, step by step
        A = torch.complex(-h3.inv_A_real.exp(), h3.A_imag)  # (H, N/2), one of each conjugate pair
        dt, B, C = h3.log_dt.exp()[:, None], torch.view_as_complex(h3.B), torch.view_as_complex(h3.C)
        A_bar, B_bar = (1 + dt * A / 2) / (1 - dt * A / 2), dt * B / (1 - dt * A / 2)
        state, impulse = B_bar, []                                  # x_0 = B̄ u_0 with u = (1, 0, 0, ...)
        for _ in range(L):
            impulse.append(2 * (C * state).sum(1).real)             # y = Re(C x) over conjugate pairs
            state = A_bar * state                                   # x_t = Ā x_{t-1}
        torch.testing.assert_close(want, torch.stack(impulse, 1), rtol=1e-9, atol=1e-9)
    got = h3.ssm_kernel(L)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    w = torch.randn_like(want)
    g_want = torch.autograd.grad((want * w).sum(), params)
    g_got = torch.autograd.grad((got * w).sum(), params)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("d_state, L", [(16, 7), (16, 40), (1024, 37)])
def test_h3_shift_kernel_is_the_cross_correlation(d_state, L):
    h3 = m.H3(m.Config(arch="h3", d_model=4), 0, d_state=d_state).double()
    with torch.no_grad():
        h3.shift_B.normal_()
    Bs, Cs = h3.shift_B, h3.shift_C
    want = torch.stack([(Bs[:, :d_state - j] * Cs[:, j:]).sum(-1) if j < d_state else Bs.new_zeros(4)
                        for j in range(L)], dim=1)
    got = h3.shift_kernel(L)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    w = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((got * w).sum(), [Bs, Cs]), torch.autograd.grad((want * w).sum(), [Bs, Cs])):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_parameter_and_flop_counts_of_the_step_benchmark():
    """What `python test_mecheval.py steps` prints beside its times, on any torch: attention's blocks at d = 16 and
    64 (the README's column) by hand, and every architecture counted from its blocks."""
    for d, L in ((16, 9), (64, 37)):
        model = m.build_model(m.Config(d_model=d), 100)
        params, in_blocks, flops = counts(model, torch.randint(3, 100, (2, L)))
        assert in_blocks == sum(p.numel() for p in model.blocks.parameters()) and params == in_blocks + 100 * d + 2 * d + \
            m.MAX_LEN * d  # + the embedding, the final LayerNorm and the positions
        assert flops == 2 * (24 * d * d + 4 * L * d)  # 2 layers: Wqkv 3d², out d², MLP 8d², 2 FLOPs a weight; q kᵀ, A v
    assert counts(m.build_model(m.Config(arch="mamba", d_model=64), 100), torch.randint(3, 100, (2, 37)))[1] == 65_408
    usage = subprocess.run([sys.executable, __file__, "nothing"], capture_output=True, text=True, cwd=HERE)
    assert usage.returncode == 2 and "usage: python test_mecheval.py kernels | steps" in usage.stderr
    wrong = subprocess.run([sys.executable, __file__, "steps", "--sweep"], capture_output=True, text=True, cwd=HERE)
    assert wrong.returncode == 2 and wrong.stderr.strip() == "error: --sweep does not time steps; give Config flags only"


def test_presets_expand_to_the_paper_grids():
    p = m.presets()
    seven = ["attention", "based", "mamba", "deltanet", "base_conv", "hyena", "h3"]  # the file's order
    assert [s["arch"] for _, s in p["ar"]] == seven and all(s["task"] == "ar" for _, s in p["ar"])
    assert {s["atr_setting"] for k in ("atr_easy", "atr_medium", "atr_8192") for _, s in p[k]} == set(m.ATR_SETTINGS)
    assert [s["d_conv"] for _, s in p["mamba_conv"]] == ["0", "1", "2", "3", "4"]
    assert [(s["task"], s["d_conv"]) for _, s in p["atr_mamba_conv"]] == [("atr", w) for w in "01234"]
    assert [s["d_conv"] for _, s in p["based_conv"]] == ["1", "2", "3", "4", "long"]
    assert {s["n_layers"] for _, s in p["layers"]} == {1, 3}
    flipped = [("attention", "off"), ("mamba", "on"), ("based", "on"), ("hyena", "on")]  # App. D.1
    assert [(s["arch"], s["pos_emb"]) for _, s in p["pos_emb"]] == flipped
    assert [(s["arch"], s["atr_split"]) for _, s in p["atr_gen"]] == [(a, "gen") for a in seven]  # one training each
    assert [s["arch"] for _, s in p["seeds"]] == seven
    assert [(s["arch"], s["n_layers"], s["atr_query"]) for _, s in p["atr_sibling"]][-4:] == [
        ("h3", 1, "sibling"), ("h3", 2, "sibling"), ("h3", 3, "sibling"), ("based", 1, "sibling")]  # App. D.4
    for runs in p.values():  # every entry is a valid config
        for _, settings in runs:
            m.Config(**settings)


def test_presets_sweep_the_paper_grid_and_the_seeds_preset_three_seeds(tmp_path, monkeypatch):
    grids = []
    monkeypatch.setattr(m, "run_sweeps", lambda title, entries, widths, lrs, out_dir, log, seeds:
                        grids.append((widths, lrs, seeds)))
    for name in ("ar", "seeds"):
        m.run_preset(name, dict(out_dir=str(tmp_path)))
    m.run_preset("seeds", dict(out_dir=str(tmp_path)), widths=(32,), lrs=(1e-2,), seeds=(5,))
    assert grids == [(m.PAPER_WIDTHS, None, None), (m.PAPER_WIDTHS, None, (0, 1, 2)), ((32,), (1e-2,), (5,))]


def test_preset_entries_resolve_their_own_schedule_and_default_lr(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(m, "train", lambda cfg, log: seen.append(cfg) or {"status": "completed", "final_acc": 0.5})
    monkeypatch.setattr(m, "presets", lambda: {"x": [("atr", dict(task="atr", arch="mamba")),
                                                     ("ar", dict(task="ar", arch="based", steps=7))]})
    summary = m.run_preset("x", dict(out_dir=str(tmp_path)), widths=(16,), lrs=(0.0,), log=lambda s: None)
    assert [(c.task, c.steps, c.lr, c.d_model) for c in seen] == [("atr", 100_032, m.DEFAULT_LR["mamba"], 16),
                                                                  ("ar", 7, m.DEFAULT_LR["based"], 16)]
    assert [r["acc"] for r in summary["rows"]] == [50.0, 50.0]


def fake_result(acc, value):
    """A finished run's results.json with a final accuracy and a layer-1 block_input attribution at the value."""
    grid = [{"site": "block_input", "layer": 1, "position": k, "attribution": value if k == "value" else 0.0}
            for k in ("value", "key", "query")]
    return {"status": "completed", "final_acc": acc, "final_p_answer": acc / 2, "mechanism": {"n_layers": 2, "grid": grid}}


def test_seed_sweep_picks_the_rate_on_the_mean_and_averages_mechanisms_over_successes(tmp_path, monkeypatch):
    table = {(1e-3, 0): (0.95, 1.0), (1e-3, 1): (0.05, 0.2), (1e-3, 2): (0.10, 0.3),   # the best run; mean 36.67
             (1e-2, 0): (0.70, 1.0), (1e-2, 1): (0.65, 0.8), (1e-2, 2): (0.30, 0.0)}   # mean 55: the best rate
    monkeypatch.setattr(m, "train", lambda cfg, log: fake_result(*table[cfg.lr, cfg.seed]))
    base = m.Config(d_model=8, out_dir=str(tmp_path))
    (row,) = m.sweep(base, widths=(8,), lrs=(1e-3, 1e-2), seeds=(0, 1, 2), log=lambda s: None)["rows"]
    assert row["best_lr"] == 1e-2 and row["n"] == 3 and row["successes"] == 2
    assert row["acc"] == pytest.approx(55.0) and row["acc_std"] == pytest.approx(475 ** 0.5)  # deviations 15, 10, -25
    assert (row["acc_min"], row["acc_max"]) == pytest.approx((30.0, 70.0))
    assert row["attribution"]["value"] == pytest.approx(0.9), "the mean over the two seeds that succeeded"
    other = row["acc_by_lr"]["0.001"]
    assert other["acc"] == pytest.approx(110 / 3) and other["successes"] == 1 and other["acc_max"] == pytest.approx(95)
    md = (tmp_path / "summary.md").read_text()
    assert "| 55.00 ± 21.79 | 30.00–70.00 | 2/3 |" in md and "36.67" not in md  # the other rate: summary.json only


def test_seed_sweep_from_the_command_line_trains_every_seed(tmp_path, capsys):
    argv = ["--sweep", "--widths", "8", "--lrs", "1e-3", "--seeds", "0,1", "--n_pairs", "3",
            "--n_keys", "10", "--n_values", "10", "--n_train", "200", "--n_eval", "40", "--steps", "10",
            "--eval_every", "10", "--no-analyze", "--out_dir", str(tmp_path)]
    assert m.main(argv) == 0
    runs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert runs == ["ar_attention_d8_l2_lr0.001_s0", "ar_attention_d8_l2_lr0.001_s1"]
    accs = [100 * json.loads((tmp_path / r / "results.json").read_text())["final_acc"] for r in runs]
    (row,) = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert row["n"] == 2 and row["acc"] == pytest.approx(sum(accs) / 2)
    assert m.main(argv[:6] + ["-1", "--out_dir", str(tmp_path)]) == 2
    assert "seed must be an integer from 0 to 2**63 - 1, not -1" in capsys.readouterr().err


def test_preset_from_the_command_line_sweeps_each_entry_into_its_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(m, "presets", lambda: {"two": [("attention", dict(task="ar", arch="attention")),
                                                       ("deltanet", dict(task="ar", arch="deltanet"))]})
    argv = ["--preset", "two", "--widths", "8", "--lrs", "1e-3", "--seeds", "1", "--n_pairs", "3", "--n_keys", "10", "--n_values", "10",
            "--n_train", "200", "--n_eval", "40", "--steps", "10", "--eval_every", "10", "--no-analyze",
            "--out_dir", str(tmp_path)]
    assert m.main(argv) == 0
    assert "preset two: 2 sweep(s), 2 runs" in capsys.readouterr().out
    for arch in ("attention", "deltanet"):
        res = json.loads((tmp_path / arch / f"ar_{arch}_d8_l2_lr0.001_s1" / "results.json").read_text())
        assert res["status"] == "completed" and res["config"]["steps"] == 10
        assert "| 8 |" in (tmp_path / arch / "summary.md").read_text()
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert [(r["label"], r["n"], r["run"]) for r in rows] == [("attention", 1, "ar_attention_d8_l2_lr0.001_s1"),
                                                              ("deltanet", 1, "ar_deltanet_d8_l2_lr0.001_s1")]
    monkeypatch.undo()
    assert m.main(["--preset", "nope"]) == 2 and "allowed: ar, atr_easy" in capsys.readouterr().err
    monkeypatch.setattr(m, "run_sweeps", lambda *a, **k: "swept")
    assert m.main(["--preset", "ar", "--arch", "mamba"]) == 2  # a flag the preset would ignore is refused
    assert "preset ar sets arch itself; leave out --arch" in capsys.readouterr().err
    assert m.run_preset("ar", dict(task="ar"), widths=(8,)) == "swept"  # one that agrees with it is kept


@pytest.mark.parametrize("arch", ["mamba", "mamba beyond unroll", "deltanet", "hyena"])
def test_compiled_training_follows_the_eager_trajectory(arch, tmp_path, monkeypatch):
    """--compile trains the same run: the first 20 steps (losses every 5 steps, then every weight) equal the eager
    run's to float32 reassociation. The compiled graph fuses and reorders sums (~1e-7 relative per op); AdamW
    divides each gradient by its own running scale, so such differences stay near that size in the weights
    instead of being amplified, and 1e-4 leaves room while a wrong gradient or a skipped step moves far more."""
    if arch == "mamba beyond unroll":  # the scan's loop runs eager inside the compiled step
        monkeypatch.setattr(m.Mamba, "unroll", 0)
        arch = "mamba"
    runs = {}
    for compile in (False, True):
        cfg = small_ar(arch=arch, d_model=16, n_layers=1, n_pairs=3, steps=20, eval_every=5, target_acc=0, analyze=False,
                       compile=compile, out_dir=str(tmp_path / str(compile)))
        runs[compile] = (m.train(cfg, log=lambda s: None)["history"],
                         torch.load(tmp_path / str(compile) / cfg.run_name / "model.pt")["model"])
    (eager, w_eager), (compiled, w_compiled) = runs[False], runs[True]
    assert [h["step"] for h in compiled] == [5, 10, 15, 20]
    for a, b in zip(eager, compiled):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a, b)
    drift = max(((w_eager[k] - w_compiled[k]).abs().max() / w_eager[k].abs().max()).item() for k in w_eager)
    assert drift < 1e-4, drift


# --------------------------------------------------------------------------------------------- your own mixer

def readme_section(title):
    text = open(os.path.join(HERE, "README.md")).read().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_brings_its_own_mixer(tmp_path, monkeypatch, capsys):
    """The README's "Your own mixer" code, run as it is written: it registers a mixer, trains it on a small AR
    and prints its verdict; the grid has the mixer's sites and its short convolution's."""
    monkeypatch.setattr(m, "ARCHS", dict(m.ARCHS))  # the registration ends with the test
    monkeypatch.setattr(m, "DEFAULT_LR", dict(m.DEFAULT_LR))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "mecheval", m)
    scope = {}
    exec(compile(readme_section("Your own mixer"), "README.md", "exec"), scope)
    results, out = scope["results"], capsys.readouterr().out
    assert results["status"] in ("completed", "target reached") and (tmp_path / "runs").is_dir()
    assert out.strip().endswith(m.verdict_text(results["mechanism"]["verdict"]))
    assert {"conv_output", "mixer_output"} <= {g["site"] for g in results["mechanism"]["grid"]}


def test_a_mixer_that_breaks_the_contract_is_refused_in_one_sentence(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(m, "ARCHS", dict(m.ARCHS))
    monkeypatch.setattr(m, "DEFAULT_LR", dict(m.DEFAULT_LR))

    @m.register("half", lr=1e-3)
    class Half(torch.nn.Module):  # returns d/2 channels
        def __init__(self, cfg, layer_idx):
            super().__init__()
            self.proj = torch.nn.Linear(cfg.d_model, cfg.d_model // 2)

        def forward(self, u):
            return self.proj(u)

    @m.register("peek", lr=1e-3)
    class Peek(torch.nn.Module):  # the mean over the whole sequence: reads the future
        def __init__(self, cfg, layer_idx):
            super().__init__()

        def forward(self, u):
            return u.mean(1, keepdim=True).expand_as(u)

    @m.register("running_mean", lr=1e-3)
    class RunningMean(torch.nn.Module):  # causal: passes
        def __init__(self, cfg, layer_idx):
            super().__init__()

        def forward(self, u):
            return u.cumsum(1) / torch.arange(1, u.shape[1] + 1)[:, None]

    with pytest.raises(m.ConfigError, match=r"^mixer 'half' returned \(33, 32, 8\) for an input of shape \(33, 32, 16\); "
                                            r"a mixer maps \(B, L, d\) to \(B, L, d\), causally$"):
        m.build_model(m.Config(arch="half", d_model=16), 20)
    assert m.build_model(m.Config(arch="running_mean", d_model=16), 20) is not None
    assert m.main(TINY + ["--arch", "peek", "--out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: mixer 'peek' is not causal: its output at position 0 changed") and err.count("\n") == 1

    @m.register("blocks_of_8", lr=1e-3)
    class BlocksOf8(torch.nn.Module):  # attends freely inside blocks of 8 tokens: reads up to 7 ahead
        def __init__(self, cfg, layer_idx):
            super().__init__()

        def forward(self, u):
            B, L, d = u.shape
            pad = -L % 8
            x = torch.nn.functional.pad(u, (0, 0, 0, pad)).view(B, -1, 8, d)
            return x.mean(2, keepdim=True).expand_as(x).reshape(B, -1, d)[:, :L]

    @m.register("peek_8", lr=1e-3)
    class Peek8(torch.nn.Module):  # causal but for one input 8 tokens ahead
        def __init__(self, cfg, layer_idx):
            super().__init__()

        def forward(self, u):
            return u + torch.nn.functional.pad(u[:, 8:], (0, 0, 0, 8))

    for arch, words in (("blocks_of_8", "position 0 changed with its input after position 0"),
                        ("peek_8", "position 0 changed with its input after position 0")):
        with pytest.raises(m.ConfigError, match=f"mixer '{arch}' is not causal: its output at {words}"):
            m.build_model(m.Config(arch=arch, d_model=16), 20)
    with pytest.raises(m.ConfigError, match=r"register\('bad', lr=-1\): the default learning rate must be a positive"):
        m.register("bad", lr=-1)


# ------------------------------------------------------------------ bad input: one true sentence, nothing lost

@pytest.mark.parametrize("argv, words", [
    (["--lr", "-1e-3"], ["lr must be a positive number", "-0.001"]),           # not "expected one argument"
    (["--arch", "mamba", "--d_conv", "²"], ["d_conv=² is not a width for mamba"]),  # a digit to Python, not int()
    (["--seed", str(2 ** 64)], ["seed=18446744073709551616 is out of range: below 2**63"]),
    (["--sweep", "--d_model", "16"], ["--sweep sets each run's d_model", "leave out --d_model"]),
    (["--sweep", "--lr", "1e-2"], ["--sweep sets each run's lr"]),
    (["--sweep", "--run_name", "x"], ["--sweep sets each run's run_name"]),
    (["--preset", "ar", "--run_name", "x"], ["--preset sets each run's run_name"]),
    (["--preset", "ar", "--d_model", "16"], ["--preset sets each run's d_model"]),
    (["--steps", "20", "--analyze_every", "2000"], ["analyze_every=2000 is more than the steps"]),
    (["--sweep", "--widths", "8,8"], ["the grid names run ar_attention_d8_l2_lr", "twice"]),
    (["--sweep", "--widths", "8", "--seeds", "0,0"], ["twice"]),
    (["--sweep", "--widths", "8", "--lrs", "1e-3,0.001"], ["twice"]),
    (["--sweep", "--widths", "8", "--lrs", "0,1e-3"], ["twice"]),                 # 0 is attention's 1e-3
])
def test_cli_refuses_before_writing(argv, words, capsys, tmp_path):
    assert m.main(SMALL + argv + ["--out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert all(w in err for w in words), err
    assert not os.listdir(tmp_path)


def test_files_of_another_tool_or_sweep_are_refused_and_kept(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "results.json").write_text('{"foo": 1}')  # another tool's JSON object: not trained into
    assert m.main(TINY + ["--out_dir", str(tmp_path), "--run_name", "r"]) == 2
    assert "results.json is not a file this tool wrote or can read (no 'config')" in capsys.readouterr().err
    (run / "results.json").unlink()
    (run / "config.json").write_text('{"task": "ar", "arch": "attention"}')
    assert m.main(TINY + ["--out_dir", str(tmp_path), "--run_name", "r"]) == 2
    assert "holds a run with no n_pairs (the default, 16), not n_pairs=3" in capsys.readouterr().err
    assert os.listdir(run) == ["config.json"]
    sweep = lambda w: SMALL + ["--sweep", "--widths", w, "--lrs", "1e-3", "--out_dir", str(tmp_path / "s")]
    os.makedirs(tmp_path / "s")
    (tmp_path / "s" / "summary.md").write_text("my notes")  # a user's own
    assert m.main(sweep("8")) == 2
    assert "holds another summary" in capsys.readouterr().err and os.listdir(tmp_path / "s") == ["summary.md"]
    (tmp_path / "s" / "summary.md").unlink()
    assert m.main(sweep("8")) == 0
    summary = lambda: [(tmp_path / "s" / f).read_bytes() for f in ("summary.json", "summary.md")]
    before = summary()
    assert m.main(sweep("8")) == 0  # the same sweep again: its own summary, rewritten
    assert m.main(sweep("16")) == 2
    assert "holds another summary" in capsys.readouterr().err and summary() == before


def test_messages_name_only_files_that_exist(tmp_path, capsys, monkeypatch):
    assert m.main(TINY + ["--lr", "1e30", "--out_dir", str(tmp_path), "--run_name", "nan"]) == 1
    err = capsys.readouterr().err
    assert "no checkpoint was kept" in err and not (tmp_path / "nan" / "model.pt").exists()
    monkeypatch.setattr(m, "make_task", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert m.main(TINY + ["--out_dir", str(tmp_path / "i")]) == 130
    err = capsys.readouterr().err
    assert "folder" not in err and "checkpoint, if any" in err and not (tmp_path / "i").exists()
    monkeypatch.undo()
    real = m.save_file

    def full_disk(path, obj):  # the final weights cannot be written
        if path.endswith("model.pt") and "optimizer" not in obj:
            raise m.ConfigError(f"cannot write {path} (No space left on device); that file keeps what it held before")
        real(path, obj)
    monkeypatch.setattr(m, "save_file", full_disk)
    argv = TINY + ["--out_dir", str(tmp_path), "--run_name", "disk", "--no-analyze"]
    assert m.main(argv) == 2
    monkeypatch.undo()
    ckpt = torch.load(tmp_path / "disk" / "model.pt", weights_only=True)
    assert ckpt["step"] == 30 and "optimizer" in ckpt  # the checkpoint of the last step, the same weights
    assert json.loads((tmp_path / "disk" / "results.json").read_text())["status"] == "trained"  # not finished
    capsys.readouterr()
    assert m.main(argv) == 0  # the same command writes the weights, training nothing again
    out = capsys.readouterr().out
    assert "from its checkpoint at step 30 of 30" in out and "done (completed)" in out and "\nstep " not in out
    assert "optimizer" not in torch.load(tmp_path / "disk" / "model.pt", weights_only=True)
    cfg, model = m.load_run(str(tmp_path / "disk"))
    assert all(torch.equal(v, ckpt["model"][k]) for k, v in model.state_dict().items())


def test_the_core_names_nothing_defined_below_the_machinery_banner():
    """A reader of the paper's part, everything above the machinery banner, never needs a name defined below it:
    every name a function, class or statement up there reads is its own, a builtin, an import, or defined above."""
    src = open(os.path.join(HERE, "mecheval.py")).read()
    banner = src.split("\n").index("# The rest is machinery: validation, run folders and resume, sweeps and presets, "
                                   "command line.") + 1
    tree = ast.parse(src)
    below = {t.id if isinstance(t, ast.Name) else node.name for node in tree.body if node.lineno > banner
             for t in (node.targets if isinstance(node, ast.Assign) else [node])
             if isinstance(t, ast.Name) or isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert {"Config", "config_errors", "check_mixers", "Run", "train", "default_run_name"} <= below
    reached = []
    for node in (node for node in tree.body if node.lineno < banner):
        own = {a.arg for f in ast.walk(node) if isinstance(f, (ast.FunctionDef, ast.Lambda))
               for a in f.args.args + f.args.kwonlyargs}
        own |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        reached += [(n.lineno, n.id) for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                    and n.id in below and n.id not in own]
    assert not reached, f"the core reaches into the machinery: {reached}"


def test_the_python_api_refuses_in_one_sentence(tmp_path):
    cfg = m.Config(n_pairs=3, n_keys=10, n_values=10, n_train=64, n_eval=16, steps=4, eval_every=2,
                   d_model=8, out_dir=str(tmp_path))
    for k, v in (("lr", 0), ("steps", 0), ("run_name", ""), ("task", "xx")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cfg, k, v)
    assert not os.listdir(tmp_path)
    with pytest.raises(m.ConfigError, match="that arch is registered already"):
        m.register("mamba", lr=1e-3)
    with pytest.raises(m.ConfigError, match="the default learning rate must be a positive number"):
        m.register("new", lr=True)
    assert m.ARCHS["mamba"] is m.Mamba and "new" not in m.ARCHS
    task, model = m.make_task(cfg), m.build_model(cfg, m.make_task(cfg).vocab_size)
    other = m.make_task(m.replace(cfg, n_keys=40, n_values=40, run_name=""))
    smaller = m.make_task(m.replace(cfg, n_keys=4, n_values=4, run_name=""))  # every id inside the model's table
    atr = m.make_task(m.Config(task="atr", n_train=64, n_eval=16, atr_setting="8192"))
    for split, n in ((other.eval, 83), (smaller.eval, 11), (smaller.eval[:5], 11), (atr.eval, 8195)):
        for call in (lambda: m.mechanism(model, m.replace(task, eval=split)), lambda: m.evaluate(model, split)):
            with pytest.raises(ValueError, match=f"this split is of a task of {n} tokens, not of this model's 23"):
                call()  # (a task of 23 tokens, ATR easy, is read as this one's: the model knows only its size)
    with pytest.raises(ValueError, match="unknown corrupt 'query'; allowed: key, value"):
        m.mechanism(model, task, corrupt="query")
    with pytest.raises(ValueError, match="seed must be an integer from 0 to 2\\*\\*63 - 1, not 18446744073709551616"):
        m.mechanism(model, task, seed=2 ** 64)
    with pytest.raises(ValueError, match="this split holds no documents"):
        m.evaluate(model, task.eval[:0])
    for size in (0, -1, 2.5):
        with pytest.raises(ValueError, match=f"batch_size must be a positive integer, not {size}"):
            m.evaluate(model, task.eval, batch_size=size)
    for name in ("../x", "a/b", "", "x y"):
        with pytest.raises(m.ConfigError, match="the name must be a Python identifier"):
            m.register(name, lr=1e-3)
    m.train(cfg)
    run = os.path.join(cfg.out_dir, cfg.run_name)
    with pytest.raises(m.ConfigError, match="foo is not a setting of Config"):
        m.load_run(run, foo=1)
    ckpt = torch.load(os.path.join(run, "model.pt"), weights_only=True)
    del ckpt["vocab_size"]
    torch.save(ckpt, os.path.join(run, "model.pt"))
    with pytest.raises(m.ConfigError, match="model.pt is not a file this tool wrote or can read \\(no 'vocab_size'\\)"):
        m.load_run(run)


def test_verdict_reads_only_a_key_corruption_and_a_printed_tie_is_mixed():
    mech = {**fake_mech(2, {**LAST, B1("value"): 0.9}), "corrupt": "value"}
    assert m.verdict(mech)["kind"] == "not read (value corrupted)"
    for value, key, want in ((0.644, 0.636, "mixed"), (0.646, 0.636, "induction")):  # 0.64 / 0.64; 0.65 / 0.64
        assert m.verdict(fake_mech(2, {**LAST, B1("value"): value, B1("key"): key}))["kind"] == want


def test_the_causality_probe_reaches_as_far_as_a_document():
    @m.register("peek_100", lr=1e-3)
    class Peek100(torch.nn.Module):  # reads 100 positions ahead
        def __init__(self, cfg, layer_idx):
            super().__init__()

        def forward(self, u):
            out = u.clone()
            out[:, :-100] += u[:, 100:]
            return out

    with pytest.raises(m.ConfigError, match="mixer 'peek_100' is not causal: its output at position 0 changed"):
        m.build_model(m.Config(arch="peek_100", d_model=16), 20)


# ---------------------------------------------------------------------------------------------- benchmarks
# Not run by pytest: `python test_mecheval.py kernels` times each kernel's reference and fast form;
# `python test_mecheval.py steps [mecheval's flags]` a training step of every architecture (--arch: that one).

def timeit(fn, device="cpu", reps=11):
    """(median ms of reps calls of fn, seconds of the first call, which warms up or compiles). The median
    is robust to a busy machine; a call of over a second (a slow reference) is repeated 3 times at most."""
    sync = {"cuda": torch.cuda.synchronize, "mps": lambda: torch.mps.synchronize()}.get(device[:4], lambda: None)
    times = []
    while len(times) < 1 + (min(reps, 3) if times and times[0] > 1.0 else reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times[1:])[len(times[1:]) // 2], times[0]


def bench_kernels():
    torch.set_flush_denormal(True)
    for device in ["cpu"] + ["cuda"] * torch.cuda.is_available() + ["mps"] * torch.backends.mps.is_available():
        reps, gen = 11 if device == "cpu" else 20, torch.Generator().manual_seed(0)
        print(f"kernels benchmark on {device}: forward + backward, median ms of {reps} calls (B, L, d); "
              f"ratio = reference / fast")
        print(f"{'op':<24}{'shape':>14}{'reference':>11}{'fast':>9}{'ratio':>8}")
        for op, (ref, fast) in PAIRS.items():
            for B, L, d in ((32, 37, 64), (32, 200, 64)):
                args = [a.to(device).requires_grad_(a.is_floating_point()) for a in _inputs(op, B, L, d, gen)]
                t_ref, t_fast = (timeit(lambda: fn(*args).sum().backward(), device, reps)[0] for fn in (ref, fast))
                print(f"{op:<24}{str((B, L, d)):>14}{t_ref:11.2f}{t_fast:9.2f}{t_ref / t_fast:7.1f}x")


def counts(model, ids):
    """(parameters, those in blocks, forward FLOPs a token of the blocks): what FlopCounterMode counts, matrix
    products and convolutions (an FFT, element-wise ops and a scan's decays are free), with attention written out
    (torch 2.14 no longer counts scaled_dot_product_attention's products; 2.13 counted them the same)."""
    with torch.utils.flop_counter.FlopCounterMode(display=False) as flops, with_reference_attention(), torch.no_grad():
        model.hidden(ids)
    n = lambda module: sum(p.numel() for p in module.parameters())
    return n(model), n(model.blocks), flops.get_total_flops() / ids.numel()


def bench_steps(cfg, n=20, archs=None):
    """ms a training step of every architecture (or archs) at cfg's sizes (median of n), compiled too (3 rounds,
    fastest kept), on the first batch_size documents; its counts; with analyze_every, the cost of watch."""
    device = m.setup(cfg)
    task = m.make_task(m.replace(cfg, n_train=cfg.batch_size, n_eval=1))
    batch = [t.to(device) for t in (task.train.input_ids, task.train.pos["query"], task.train.answers)]
    watched = m.make_task(m.replace(cfg, n_train=cfg.n_eval)) if cfg.analyze_every else None  # what watch reads
    print(f"training step, {cfg.task}, L={batch[0].shape[1]}, d={cfg.d_model}, {cfg.n_layers} layers, "
          f"B={cfg.batch_size}, {device}, {n} steps")
    times = {}
    for arch in archs or m.ARCHS:
        model = m.build_model(m.replace(cfg, arch=arch, lr=0.0, d_conv="auto", run_name=""), task.vocab_size).to(device)
        optimizer, fns = torch.optim.AdamW(model.parameters(), lr=1e-4), [m.answer_loss] + [m.step_loss(True, device)] * cfg.compile
        t = [[timeit(lambda: m.train_step(model, optimizer, *batch, fn), device, n) for fn in fns]
             for _ in range(3 if cfg.compile else 1)]  # t[round][eager, compiled] = (ms, first call s)
        times[arch] = min(r[0][0] for r in t)
        line = f"{arch:<10} {times[arch]:8.2f} ms/step"
        line += f" {times[arch] / times['attention']:6.2f}x attention" if "attention" in times else ""
        params, in_blocks, flops = counts(model, batch[0])
        line += f" | {params:>9,} parameters ({in_blocks:>7,} in blocks), {flops:>7,.0f} FLOPs a token"
        if cfg.compile:
            ms = min(r[1][0] for r in t)
            line += f" | compiled {ms:8.2f} ms, {times[arch] / ms:5.2f}x faster; first step {t[0][1][1]:.0f} s"
        if cfg.analyze_every:  # the cost of watch, against the steps between two checks
            ms = timeit(lambda: m.watch(model, watched, cfg), device, 5)[0]
            line += f" | watch {ms:.0f} ms, {ms / (cfg.analyze_every * times[arch]):.1%} of {cfg.analyze_every} steps"
        print(line)
    return times


if __name__ == "__main__":
    what, flags = sys.argv[1] if len(sys.argv) > 1 else "", sys.argv[2:]
    if what == "kernels" and not flags:
        bench_kernels()
    elif what == "steps":
        args = m.parse_args(flags)
        other = [k for k in args if k not in {f.name for f in m.fields(m.Config)}]
        try:
            if other:
                raise m.ConfigError(f"--{other[0]} does not time steps; give Config flags only")
            bench_steps(m.Config(**args), archs=[args["arch"]] if "arch" in args else None)  # --arch: that one only
        except m.ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    else:
        print("usage: python test_mecheval.py kernels | steps [mecheval's flags, e.g. --arch mamba --compile]",
              file=sys.stderr)
        sys.exit(2)
