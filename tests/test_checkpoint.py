"""The random checkpoint generator (tools/make_checkpoint.py): published layout, determinism,
tokenizer, voice files, and loading by the real loaders."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil

import pytest
import torch
from safetensors import safe_open

from services.common.checkpoint import CheckpointPaths, InvalidVoice
from services.codec.mimi import MimiConfig, MimiModel
from services.talker.text import TextTokenizer
from services.talker.model import LMConfig, LMModel
from services.talker.voices import RING, VoicePrompt, load_voice, save_voice
from tools.make_checkpoint import VOICE_NAMES, build_random_checkpoint, cache_dir, ensure_checkpoint, write_checkpoint

FILES = ["config.json", "model.safetensors", "tokenizer-e351c8d8-checkpoint125.safetensors",
         "tokenizer_spm_32k_3.model", *(f"voices/{v}.pt" for v in VOICE_NAMES)]


def _shapes(path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_layout_and_published_key_names(tiny_checkpoint):
    paths = CheckpointPaths.open(tiny_checkpoint)
    assert sorted(p.relative_to(tiny_checkpoint).as_posix() for p in tiny_checkpoint.rglob("*")
                  if p.is_file()) == sorted(FILES)
    cfg = LMConfig.tiny()
    lm = _shapes(paths.lm)
    assert lm == LMModel.published_shapes(cfg)
    # the published naming scheme, spot-checked by hand (all 16 depformer steps present)
    assert lm["depformer.layers.0.self_attn.in_proj_weight"] == (16 * 3 * cfg.dep_dim, cfg.dep_dim)
    assert lm["depformer.layers.1.gating.15.linear_out.weight"] == (cfg.dep_dim, cfg.dep_hidden)
    assert lm["text_emb.weight"] == (cfg.text_card + 1, cfg.dim) and lm["emb.15.weight"] == (cfg.card + 1, cfg.dim)
    assert "depformer_emb.14.weight" in lm and "depformer_emb.15.weight" not in lm
    mimi = _shapes(paths.mimi)
    assert mimi == {k: tuple(v.shape) for k, v in MimiModel(MimiConfig.tiny()).state_dict().items()}
    assert "quantizer.rvq_first.vq.layers.0._codebook.embedding_sum" in mimi
    section = paths.serve_config()
    assert section["preset"] == "tiny" and section["seed"] == 0
    assert LMConfig.from_dict(section["lm"]) == cfg and MimiConfig.from_dict(section["mimi"]) == MimiConfig.tiny()
    assert paths.voice_names() == [f"{v}.pt" for v in VOICE_NAMES]


def test_real_loaders_accept_the_files(tiny_checkpoint):
    paths = CheckpointPaths.open(tiny_checkpoint)
    cfg = LMConfig.from_dict(paths.serve_config()["lm"])
    lm8 = LMModel.load(paths.lm, cfg, dep_steps=8)
    assert lm8.dep_steps == 8 and lm8.depformer_in[7].weight.shape == (cfg.dep_dim, cfg.dim)
    full = LMModel.load(paths.lm, cfg, dep_steps=16)
    with safe_open(str(paths.lm), framework="pt") as f:
        assert torch.equal(full.state_dict()["transformer.layers.0.gating.linear_in.weight"],
                           f.get_tensor("transformer.layers.0.gating.linear_in.weight"))
    mimi = MimiModel.load(paths.mimi, MimiConfig.from_dict(paths.serve_config()["mimi"]))
    codes = mimi.encode(torch.zeros(1, 1, 1920))
    assert codes.shape == (1, 8, 1)


def test_same_seed_same_bytes_other_seed_differs(tiny_checkpoint, tmp_path):
    again = write_checkpoint(build_random_checkpoint("tiny", 0), tmp_path / "again")
    for f in FILES:
        assert (again / f).read_bytes() == (tiny_checkpoint / f).read_bytes(), f
    other = write_checkpoint(build_random_checkpoint("tiny", 1), tmp_path / "other")
    for f in ["model.safetensors", "tokenizer-e351c8d8-checkpoint125.safetensors", "voices/NATF2.pt", "config.json"]:
        assert (other / f).read_bytes() != (tiny_checkpoint / f).read_bytes(), f
    # the tokenizer depends only on the shipped corpus
    tokenizer = "tokenizer_spm_32k_3.model"
    assert (other / tokenizer).read_bytes() == (tiny_checkpoint / tokenizer).read_bytes()



def test_tokenizer_ids_and_system_tag(tiny_checkpoint):
    tok = TextTokenizer.load(CheckpointPaths.open(tiny_checkpoint).tokenizer)
    assert tok.vocab_size == LMConfig.tiny().text_card
    sp = tok.sp
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, 3)
    ids = tok.encode("<system> hello <system>")
    system = sp.PieceToId("<system>")
    assert system >= 4 and ids.count(system) == 2
    assert ids[0] != 1 and ids[-1] != 2  # no BOS/EOS
    assert "".join(tok.piece(i) for i in ids).split() == ["<system>", "hello", "<system>"]
    assert tok.decode(ids).split() == ["<system>", "hello", "<system>"]
    assert tok.encode_persona("hello") == ids  # wraps in <system> tags
    assert tok.encode_persona("<system> hello <system>") == ids  # already wrapped: unchanged
    assert [tok.piece(i) for i in range(4)] == ["", "", "", ""]
    assert tok.piece(-1) == "" and tok.piece(10**6) == ""
    word = sp.PieceToId("\u2581teacher")
    assert word >= 4 and tok.piece(word) == " teacher"


def test_voice_files_in_published_format(tiny_checkpoint):
    cfg = LMConfig.tiny()
    lm = LMModel.load(CheckpointPaths.open(tiny_checkpoint).lm, cfg, dep_steps=8)
    for name in VOICE_NAMES:
        raw = torch.load(tiny_checkpoint / "voices" / f"{name}.pt", weights_only=True)
        assert set(raw) == {"embeddings", "cache"}
        emb, cache = raw["embeddings"], raw["cache"]
        assert emb.dtype == torch.bfloat16 and emb.dim() == 4 and emb.shape[1:] == (1, 1, cfg.dim)
        assert cache.dtype == torch.long and cache.shape == (1, cfg.num_streams, RING)
        # embedding 0 is the start column: every stream at its initial token
        initial = torch.tensor([[[cfg.text_card] + [cfg.card] * cfg.n_q]])
        assert torch.allclose(emb[0, 0, 0].float(), lm.embed(initial)[0, 0].bfloat16().float())
        # embedding 1: text PAD, agent frame 1 q0 / initial for the delayed streams, user SINE q0
        assert torch.isfinite(emb.float()).all() and not torch.equal(emb[0], emb[1])
    voices = {n: load_voice(tiny_checkpoint / "voices" / f"{n}.pt", cfg.dim, cfg.delays, cfg.text_card, cfg.card)
              for n in VOICE_NAMES}
    assert not torch.equal(voices["NATF2"].embeddings, voices["NATM1"].embeddings)


def test_bad_voice_files_are_refused(tiny_checkpoint, tmp_path):
    cfg = LMConfig.tiny()
    good = load_voice(tiny_checkpoint / "voices" / "NATF2.pt", cfg.dim, cfg.delays, cfg.text_card, cfg.card)

    def check(name, obj, match):
        p = tmp_path / name
        torch.save(obj, p)
        with pytest.raises(InvalidVoice, match=match):
            load_voice(p, cfg.dim, cfg.delays, cfg.text_card, cfg.card)

    emb4 = good.embeddings[:, None, None].bfloat16()
    check("keys.pt", {"embeddings": emb4}, "expected keys")
    check("dim.pt", {"embeddings": torch.zeros(3, 1, 1, cfg.dim + 1), "cache": good.cache[None]}, "embeddings must be")
    check("nan.pt", {"embeddings": emb4.float() * float("nan"), "cache": good.cache[None]}, "non-finite")
    check("cache.pt", {"embeddings": emb4, "cache": good.cache[None, :, :3]}, "cache must be")
    check("ids.pt", {"embeddings": emb4, "cache": torch.full_like(good.cache[None], 99999)}, "token id")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(InvalidVoice, match="not a readable"):
        load_voice(tmp_path / "junk.pt", cfg.dim, cfg.delays, cfg.text_card, cfg.card)
    # a pickled object that is not plain tensors is refused by weights_only loading
    torch.save({"embeddings": emb4, "cache": good.cache[None], "x": object.__new__(VoicePrompt)}, tmp_path / "obj.pt")
    with pytest.raises(InvalidVoice):
        load_voice(tmp_path / "obj.pt", cfg.dim, cfg.delays, cfg.text_card, cfg.card)
    # round trip through our writer
    save_voice(tmp_path / "rt.pt", good)
    back = load_voice(tmp_path / "rt.pt", cfg.dim, cfg.delays, cfg.text_card, cfg.card)
    assert torch.equal(back.embeddings, good.embeddings) and torch.equal(back.cache, good.cache)


def _ensure(root, q):
    q.put(str(ensure_checkpoint("tiny", seed=0, root=root)))


def test_ensure_checkpoint_is_cached_and_race_safe(tiny_checkpoint, tmp_path):
    # Two processes race to create the same cached checkpoint: both get the complete directory.
    root = tmp_path / "cache"
    ctx = mp.get_context("fork")  # the parent has imported and warmed up torch already
    q = ctx.Queue()
    procs = [ctx.Process(target=_ensure, args=(root, q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    final = cache_dir("tiny", 0, root)
    assert final.name.startswith("tiny-seed0-") and final.parent == root
    got = {q.get(timeout=5), q.get(timeout=5)}
    assert got == {str(final)}
    assert [x.name for x in root.iterdir()] == [final.name]  # no temp dirs left behind
    for f in FILES:
        assert (final / f).read_bytes() == (tiny_checkpoint / f).read_bytes()
    # cached: a second call returns at once without rebuilding
    stamp = (final / "config.json").stat().st_mtime_ns
    assert ensure_checkpoint("tiny", seed=0, root=root) == final
    assert (final / "config.json").stat().st_mtime_ns == stamp
    shutil.rmtree(root)


def test_config_json_is_plain_json(tiny_checkpoint):
    data = json.loads((tiny_checkpoint / "config.json").read_text())
    assert list(data) == ["personaplex_serve"]
