"""Hugging Face models, the Trainer and Accelerate with the switch on (test extra: transformers,
accelerate). Models are built from configs (no hub access): GPT-2, Llama and BERT, tiny.

"Outputs equal plain runs where no optimization changes numerics": with ``mixed_precision="off"``
and models built with SDPA attention, nothing the switch does on this CPU changes the arithmetic
(paging, when it happens, is bit-exact), so every mode must reproduce plain PyTorch's losses
exactly; the test checks the report agrees that nothing numerics-changing was applied.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb

transformers = pytest.importorskip("transformers")

MODES = ("performance", "balanced", "memory", "full")
VOCAB, SEQ, STEPS = 64, 32, 6


def build(name: str, attn: str = "sdpa") -> torch.nn.Module:
    """A tiny model of the family, from a config, with dropout off (deterministic)."""
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cls = transformers.GPT2LMHeadModel
    elif name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
                                       bos_token_id=0, eos_token_id=0, pad_token_id=0)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
        cls = transformers.BertForMaskedLM
    cfg._attn_implementation = attn
    return cls(cfg)


def batch() -> torch.Tensor:
    """Learnable sequences (each row counts up from its own start), so the loss falls in a few steps."""
    start = torch.arange(8).unsqueeze(1) * 5
    return (start + torch.arange(SEQ)) % (VOCAB - 1) + 1


def train(name: str, mode: str | None, attn: str = "sdpa", **overrides) -> tuple[list[float], dict | None]:
    """STEPS AdamW steps; ``mode=None`` is plain PyTorch. Returns the losses and the model's decisions."""
    model = build(name, attn)
    if mode is not None:
        vb.enable(mode, banner=False, **overrides)
    dev = vb.device() if mode else torch.device("cpu")
    model = model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = batch().to(dev)  # the script placed the model: its inputs go there too
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    features = vb.get_report()["models"][0]["features"] if mode else None
    vb.disable()
    return losses, features


@functools.lru_cache(maxsize=None)
def plain(name: str) -> tuple[float, ...]:
    return tuple(train(name, None)[0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_model_trains_in_every_mode_exactly_like_plain_pytorch(name, mode, cpu_device):
    # bit-identity with plain PyTorch on the CPU: pinned, so it means the same on a GPU machine
    # the compile ladder changes numerics within its tolerance (inductor fusions, the SDPA rewrite):
    # it is tested in test_compile_ladder.py / test_compile_switch.py; here every other feature must be exact
    losses, feats = train(name, mode, mixed_precision="off", compile="off")
    assert losses[-1] < 0.8 * losses[0]
    assert feats["mixed_precision"]["chosen"] == "fp32"
    assert feats["attention"]["chosen"] == "as written" and "use SDPA" in feats["attention"]["reason"]
    assert feats["fp4"]["chosen"] == "off"  # FP4 storage is for frozen weights; these all train
    assert feats["distributed"]["chosen"] == "single process"
    assert tuple(losses) == plain(name)  # nothing numerics-changing applied: bit-identical losses


def test_the_scripts_own_checkpointing_is_left_as_configured_and_survives_disable(cpu_device):
    """A script that enabled Hugging Face activation checkpointing itself, on every other layer:
    memory mode leaves it as configured (not its own every-block policy), and ``disable()`` does
    not switch it off (until 2026-11-26 it did: training after disable() kept full activations)."""
    model = build("llama")
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=2)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=2)
    layers = list(model.model.layers)
    before = [(layer.gradient_checkpointing, layer._gradient_checkpointing_func) for layer in layers]
    assert [flag for flag, _ in before] == [True, False]
    vb.enable("memory", banner=False, mixed_precision="off", compile="off")
    model.to(vb.device()).train()
    x = batch()
    model(input_ids=x, labels=x).loss.backward()
    feats = vb.get_report()["models"][0]["features"]
    vb.disable()
    assert feats["activation_checkpointing"]["chosen"] == "the script's own"
    assert "left as it configured it" in feats["activation_checkpointing"]["reason"]
    assert [(layer.gradient_checkpointing, layer._gradient_checkpointing_func) for layer in layers] == before
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing


@pytest.mark.parametrize("name,mode", [("gpt2", "balanced"), ("llama", "memory"), ("bert", "balanced"), ("bert", "memory")])
def test_hf_model_trains_with_the_modes_own_requests(name, mode):
    losses, feats = train(name, mode)  # mixed precision as the mode and the probes decide
    assert losses[-1] < 0.8 * losses[0]
    assert "use SDPA" in feats["attention"]["reason"]


def _eager_left_as_chosen(name: str, atol: float) -> None:
    """A model the script set to eager attention stays eager (Hugging Face's own default is SDPA
    where the model supports it): its outputs and its attentions are as without the switch."""
    model = build(name, "eager").eval()
    x = batch()[:2]
    ref = model(input_ids=x, output_attentions=True)
    vb.enable("balanced", attention="sdpa", mixed_precision="off", tf32="off", banner=False)
    model.to(vb.device())
    assert model.config._attn_implementation == "eager"
    feats = vb.get_report()["models"][0]["features"]
    assert feats["attention"]["chosen"] == "as written" and "eager, chosen by the script" in feats["attention"]["reason"]
    got = model(input_ids=x.to(vb.device()), output_attentions=True)
    torch.testing.assert_close(got.logits.cpu(), ref.logits, atol=atol, rtol=1e-4)
    assert len(got.attentions) == len(ref.attentions) == 2
    vb.disable()
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_eager_attention_chosen_by_the_script_is_left_as_chosen(name, cpu_device):
    """Until 2026-11-27 the switch set such a model to SDPA: ``output_attentions=True`` came back
    empty (a probe's finding)."""
    _eager_left_as_chosen(name, atol=0.0)


def test_memory_mode_on_an_eager_llama_adopted_at_its_first_forward_is_bitwise(tmp_path, cpu_device):
    """Memory mode (its attention=auto and Hugging Face activation checkpointing) on an eager model
    adopted inside its first forward: the switch changed the attention implementation after that
    forward, so backward recomputed the checkpointed layers with the other one — a CheckpointError,
    or with attention dropout silently different gradients (a probe's findings). Bitwise now."""
    def run(switch: bool):
        torch.manual_seed(0)
        model = build("llama", "eager")
        model.config.attention_dropout = 0.1
        model.train()
        if switch:
            vb.enable("memory", swap_dir=str(tmp_path), paging="off", mixed_precision="off", banner=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = []
        try:
            for _ in range(2):
                loss = model(input_ids=batch()[:2], labels=batch()[:2]).loss
                opt.zero_grad()
                loss.backward()
                out.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
                opt.step()
            if switch:
                assert vb.get_report()["models"][0]["features"]["activation_checkpointing"]["chosen"] != "off"
        finally:
            if switch:
                vb.disable()
        return out

    plain, switched = run(False), run(True)
    for (la, ga), (lb, gb) in zip(plain, switched):
        assert la == lb and all(torch.equal(a, b) for a, b in zip(ga, gb))


from conftest import accelerator as _accelerator, needs_accelerator  # noqa: E402


@pytest.mark.gpu
@needs_accelerator
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_on_the_accelerator_routed_attention_matches_the_cpu_and_every_mode_trains(name):
    _eager_left_as_chosen(name, atol=1e-4)  # eager attention on the device vs the CPU's
    for mode in MODES:
        losses, feats = train(name, mode)
        assert losses[-1] < 0.8 * losses[0], (mode, losses)
        assert feats["placement"]["chosen"].startswith(_accelerator().type)


def test_trainer_runs_with_the_switch_on(tmp_path):
    vb.enable("balanced", banner=False)
    model = build("gpt2")
    data = [{"input_ids": row, "labels": row} for row in batch().repeat(4, 1)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=8,
                                          learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                                          disable_tqdm=True, use_cpu=vb.device().type == "cpu")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < 0.8 * losses[0]
    assert trainer.args.device.type == vb.device().type
    assert next(model.parameters()).device.type == vb.device().type
    rep = vb.get_report()
    names = [m["name"] for m in rep["models"]]
    assert names == ["GPT2LMHeadModel"]
    assert "use SDPA" in rep["models"][0]["features"]["attention"]["reason"]


def test_accelerate_prepared_loop_trains_on_the_device_the_switch_reports():
    accelerate = pytest.importorskip("accelerate")
    from torch.utils.data import DataLoader, TensorDataset

    vb.enable("balanced", banner=False)
    acc = accelerate.Accelerator(cpu=vb.device().type == "cpu")
    assert acc.device.type == vb.device().type
    model = build("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(batch().repeat(6, 1)), batch_size=8)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses = []
    for (x,) in loader:
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert next(model.parameters()).device.type == vb.device().type
    rep = vb.get_report()
    assert rep["models"][0]["name"] == "LlamaForCausalLM"
    assert rep["models"][0]["features"]["placement"]["chosen"] == str(next(model.parameters()).device)


def test_checkpointing_the_script_asks_for_after_adoption_stays_on_after_disable(tmp_path, cpu_device):
    """Memory mode switches a Hugging Face model's own checkpointing on at adoption and off at
    ``disable()``. The Trainer asks for it itself in ``train()``, after adoption; ``disable()``
    turned it off anyway (a probe's finding). Asked for by the script, it stays on."""
    import copy

    for script_asks in (False, True):
        model = build("llama", "eager")
        vb.enable("memory", swap_dir=str(tmp_path), paging="off", mixed_precision="off", banner=False)
        model.train()
        model(input_ids=batch()[:2], labels=batch()[:2]).loss.backward()
        assert model.is_gradient_checkpointing
        if script_asks:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        twin = copy.deepcopy(model)  # a copy carries the plain method
        vb.disable()
        assert model.is_gradient_checkpointing is script_asks
        assert "gradient_checkpointing_enable" not in vars(model)
        assert type(twin.gradient_checkpointing_enable).__name__ == "method"  # not the switch's wrapper


def test_a_model_switched_to_eval_before_backward_trains_as_plain_pytorch_with_the_librarys_checkpointing(cpu_device):
    """Memory mode turns a Hugging Face model's own checkpointing on. A self-distillation loop
    (a teacher pass of the same model in eval mode before ``loss.backward()``) had the library's
    recomputation run in eval mode: dropout off, ``CheckpointError`` (30 tensors saved, 27
    recomputed; a probe's finding). The switch gives the library a ``context_fn`` that recomputes
    with the flags of the forward."""

    def run(mode):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                      eos_token_id=0, resid_pdrop=0.1)  # dropout on: train and eval differ
        model = transformers.GPT2LMHeadModel(cfg)
        if mode is not None:
            vb.enable(mode, banner=False, mixed_precision="off", compile="off", paging="off")
        model.to("cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = batch()
        losses = []
        try:
            for _ in range(3):
                model.train()
                logits = model(input_ids=x).logits
                model.eval()
                with torch.no_grad():
                    teacher = model(input_ids=x).logits.softmax(-1)
                loss = F.kl_div(logits.log_softmax(-1), teacher, reduction="batchmean")
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            checkpointed = mode is not None and vb.get_report()["models"][0]["features"]["activation_checkpointing"]
        finally:
            vb.disable()
        return losses, checkpointed

    ref, _ = run(None)
    got, feature = run("memory")
    assert feature["chosen"] != "off", feature  # the library's checkpointing was on
    assert got == ref
