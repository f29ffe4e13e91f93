"""verify.workload.model (TinyGPT) and verify.workload.data (ByteCorpus over the stdlib sources)."""

from __future__ import annotations

import math
import sysconfig

import pytest
import torch

from verify.modes.build import muon_names
from verify.workload.data import ByteCorpus, local_slice, stdlib_source_files
from verify.workload.model import GPTConfig, TinyGPT

#: DDP's first gradient bucket is 1 MiB (torch.nn.parallel.DistributedDataParallel's
#: bucket_cap_mb default 25 with a first bucket of 1 MiB): the whole default model must fit.
FIRST_BUCKET_BYTES = 1024 * 1024

EXPECTED_MODULES = {
    "tok_emb", "pos_emb", "ln_f", "head",
    *(f"blocks.{i}.{m}" for i in range(2) for m in ("ln1", "attn.qkv", "attn.proj", "ln2", "mlp.fc1", "mlp.fc2")),
}  # fmt: skip


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return ByteCorpus.from_stdlib(max_bytes=1 << 20)


# ----- model ---------------------------------------------------------------------------------
def test_model_names_shapes_and_size():
    model = TinyGPT(GPTConfig())
    leaf_modules = {n for n, m in model.named_modules() if n and not list(m.children())}
    assert leaf_modules == EXPECTED_MODULES
    assert list(model.buffers()) == []
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["blocks.0.attn.qkv.weight"] == (192, 64)
    assert shapes["blocks.1.mlp.fc2.weight"] == (64, 256)
    assert shapes["head.weight"] == (256, 64)
    assert model.head.weight.data_ptr() != model.tok_emb.weight.data_ptr()  # not tied
    assert not any(n.endswith("bias") and n.startswith("blocks.") and ".ln" not in n for n in shapes)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"\nTinyGPT default: {n_params} params, {n_params * 4} bytes of float32")
    assert n_params == 135_808
    assert n_params * 4 < FIRST_BUCKET_BYTES
    assert list(muon_names(model)) == [  # the harness's Muon targets: every block's hidden matrices
        f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    ]


def test_model_init_is_deterministic_and_forward_is_causal():
    torch.manual_seed(3)
    a = TinyGPT()
    torch.manual_seed(3)
    b = TinyGPT()
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    torch.manual_seed(4)
    assert not torch.equal(TinyGPT().head.weight, a.head.weight)

    idx = torch.randint(0, 256, (2, 16))
    logits = a(idx)
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256  # a later token must not change earlier logits
    assert torch.equal(a(changed)[:, :10], logits[:, :10])
    assert not torch.equal(a(changed)[:, 10:], logits[:, 10:])
    loss = a.loss(idx, idx)
    assert loss.ndim == 0 and abs(loss.item() - math.log(256)) < 0.5  # near uniform at init


def test_model_errors():
    with pytest.raises(ValueError, match="Invalid n_heads=3 for d_model=64"):
        GPTConfig(n_heads=3)
    with pytest.raises(ValueError, match="Invalid n_layers=0"):
        GPTConfig(n_layers=0)
    with pytest.raises(TypeError):
        GPTConfig(256)  # keyword-only
    model = TinyGPT(GPTConfig(seq_len=8))
    with pytest.raises(ValueError, match="sequence length=9"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="Must be a \\(batch, seq\\) int64"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="targets shape"):
        model.loss(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))


# ----- data ----------------------------------------------------------------------------------
def test_corpus_is_the_sorted_stdlib_sources(corpus):
    files = stdlib_source_files()
    root = sysconfig.get_paths()["stdlib"]
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    assert not any(part in ("site-packages", "dist-packages") for r in rel for part in r.split("/"))
    expected = b"".join(f.read_bytes() for f in files[: corpus.num_files])[: 1 << 20]
    got = bytes(torch.cat([corpus.tokens, corpus.eval_tokens]).tolist())
    assert got == expected
    assert corpus.tokens.dtype == torch.uint8 and corpus.tokens.ndim == 1
    assert corpus.tokens.numel() + corpus.eval_tokens.numel() == 1 << 20
    assert corpus.eval_tokens.numel() == int((1 << 20) * 0.1)
    assert ByteCorpus.from_stdlib(max_bytes=1 << 20).sha256 == corpus.sha256
    assert b"def " in got  # it is Python source text


def test_global_batch_shapes_and_determinism(corpus):
    x, y = corpus.global_batch(step=5, batch_size=8, seq_len=32, seed=1)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one byte
    x2, y2 = corpus.global_batch(step=5, batch_size=8, seq_len=32, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    torch.manual_seed(123)  # the global RNG has no influence
    x3, _ = corpus.global_batch(step=5, batch_size=8, seq_len=32, seed=1)
    assert torch.equal(x, x3)
    assert not torch.equal(x, corpus.global_batch(step=6, batch_size=8, seq_len=32, seed=1)[0])
    assert not torch.equal(x, corpus.global_batch(step=5, batch_size=8, seq_len=32, seed=2)[0])
    xe, _ = corpus.global_batch(step=5, batch_size=8, seq_len=32, seed=1, split="eval")
    assert not torch.equal(x, xe)


def test_batch_windows_come_from_the_right_split():
    data = bytes(range(200))
    c = ByteCorpus.from_bytes(data, eval_fraction=0.25)  # train = 0..149, eval = 150..199
    x, y = c.global_batch(0, 64, 10)
    assert int(y.max()) <= 149
    xe, ye = c.global_batch(0, 64, 10, split="eval")
    assert int(xe.min()) >= 150 and int(ye.max()) <= 199
    assert torch.equal(ye - xe, torch.ones_like(xe))


def test_local_slice_rule(corpus):
    x, _ = corpus.global_batch(step=0, batch_size=12, seq_len=4)
    parts = [local_slice(x, r, 4) for r in range(4)]
    assert all(p.shape == (3, 4) for p in parts)
    assert torch.equal(torch.cat(parts), x)
    assert torch.equal(ByteCorpus.local_slice(x, 2, 4), x[6:9])
    with pytest.raises(ValueError, match="batch_size=12 for world_size=5. Must be divisible"):
        local_slice(x, 0, 5)
    with pytest.raises(ValueError, match=r"Invalid rank=4. Must be an int in \[0, 4\)"):
        local_slice(x, 4, 4)
    with pytest.raises(ValueError, match="Invalid world_size=0"):
        local_slice(x, 0, 0)


def test_data_errors(corpus):
    with pytest.raises(ValueError, match="Invalid split='test'"):
        corpus.global_batch(0, 2, 4, split="test")
    with pytest.raises(ValueError, match="Invalid step=-1"):
        corpus.global_batch(-1, 2, 4)
    with pytest.raises(ValueError, match="Invalid batch_size=0"):
        corpus.global_batch(0, 0, 4)
    with pytest.raises(ValueError, match="Invalid seq_len=10 for the train split of 10 bytes"):
        ByteCorpus.from_bytes(bytes(10), eval_fraction=0.0).global_batch(0, 1, 10)
    with pytest.raises(ValueError, match="Invalid eval_fraction=1.0"):
        ByteCorpus.from_bytes(bytes(10), eval_fraction=1.0)
    with pytest.raises(ValueError, match="Invalid max_bytes=1"):
        ByteCorpus.from_stdlib(max_bytes=1)
    with pytest.raises(ValueError, match="Must be an existing directory"):
        stdlib_source_files("/nonexistent/dir")


# ----- model + data ----------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    # A 136k-param model gains nothing from intra-op threads, and on a shared 2-core CI box
    # OpenMP spinning under load made a step ~10x slower than on one thread (measured).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_adamw_training_lowers_train_and_eval_loss(corpus, one_thread):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    x_eval, y_eval = corpus.global_batch(step=0, batch_size=32, seq_len=64, split="eval")
    with torch.no_grad():
        eval_before = model.loss(x_eval, y_eval).item()
    losses = []
    for step in range(30):
        x, y = corpus.global_batch(step=step, batch_size=16, seq_len=64)
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        eval_after = model.loss(x_eval, y_eval).item()
    print(f"\ntrain loss {losses[0]:.3f} -> {losses[-1]:.3f}; eval loss {eval_before:.3f} -> {eval_after:.3f}")
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert eval_after < eval_before - 1.0
