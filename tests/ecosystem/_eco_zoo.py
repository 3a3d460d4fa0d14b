"""Real-world models for the ecosystem tests: torchvision, timm and Hugging Face transformers,
built from configs with random initialisation (no weights, no hub access), small enough to train
two steps on a CPU in seconds.

Each case builds, from a fixed seed, the model, two micro-batches (gradient accumulation) and a
loss. Cases never import a library at module import: ``build()`` does, so the list of cases (and
the test ids) is the same whatever is installed, and a test skips a case whose library is missing
(``pytest.importorskip`` in the tests).

Known upstream limits are attached to their cases as ``xfail`` (the reason names the upstream
behaviour; the tests mark them ``strict`` so a fix shows).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

Batch = Any  # a tuple (positional args) or a dict (keyword args) for the model
#: loss(model output, index of the micro-batch) -> scalar
LossFn = Callable[[Any, int], torch.Tensor]
OptimizerFactory = Callable[..., torch.optim.Optimizer]

#: The libraries a case can need, as importable module names.
LIBRARIES = ("torchvision", "timm", "transformers")

#: (CPU autocast and BatchNorm/LayerNorm under real-value propagation: the CPU kernel returns the
#: saved statistics in float32, the meta kernel in the input dtype, and upstream's propagation
#: check raises (torch 2.13, 2.14; repro: test_ecosystem.py::test_cpu_autocast_norm_upstream_repro).
#: Since issue 39 the patch answers with the real kernel's outputs: the autocast cases train like
#: eager, no xfail.)


@dataclass
class Built:
    model: nn.Module
    batches: list[Batch]  # micro-batches of one optimizer step (gradient accumulation)
    loss_fn: LossFn
    optimizer: OptimizerFactory


@dataclass
class Case:
    name: str
    library: str  # the module a case needs: one of LIBRARIES
    what: str  # one line: what this case covers
    build: Callable[[], Built]
    #: the reason when upstream makes this case fail (the tests xfail it, strict)
    xfail: str | None = None
    #: the exception type upstream raises for an xfail case (the tests' `raises=`)
    xfail_raises: str | None = None


def library_version(library: str) -> str:
    return str(importlib.import_module(library).__version__)


# -- shared pieces --------------------------------------------------------------------------------


def _sgd(lr: float = 0.05) -> OptimizerFactory:
    return functools.partial(torch.optim.SGD, lr=lr, momentum=0.9)


def _adamw(lr: float = 1e-3) -> OptimizerFactory:
    return functools.partial(torch.optim.AdamW, lr=lr, weight_decay=0.01)


def _images(n: int, size: int, *, channels_last: bool = False, batches: int = 2) -> list[Batch]:
    out = []
    for _ in range(batches):
        x = torch.randn(n, 3, size, size)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        out.append((x,))
    return out


def _classify(classes: int, batches: list[Batch]) -> LossFn:
    """Cross-entropy against fixed random labels, one label set per micro-batch."""
    labels = [torch.randint(0, classes, (b[0].shape[0],)) for b in batches]

    def loss(out: Any, index: int) -> torch.Tensor:
        return F.cross_entropy(out.float(), labels[index])

    return loss


def _hf_loss(out: Any, index: int) -> torch.Tensor:
    return out.loss.float()


class Autocast(nn.Module):
    """Runs the wrapped model under CPU autocast (bfloat16), as a mixed-precision loop does."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(*args, **kwargs)


class FunctionalCall(nn.Module):
    """Calls the wrapped model through ``torch.func.functional_call`` with its parameters and
    buffers passed explicitly (the functorch style: the module is only the code)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        return torch.func.functional_call(self.model, state, args, kwargs)


# -- torchvision ----------------------------------------------------------------------------------


def _tv_resnet(
    *, channels_last: bool = False, frozen: bool = False, autocast: bool = False
) -> Callable[[], Built]:
    """torchvision's ResNet class with one BasicBlock per stage (resnet18 has two: the same ops,
    twice as many of them; the fake pass costs per op, so the zoo takes the shorter one)."""

    def build() -> Built:
        from torchvision.models.resnet import BasicBlock, ResNet

        torch.manual_seed(0)
        model: nn.Module = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)
        if frozen:  # fine-tuning: stem and first stage frozen (BatchNorm still in train mode)
            for part in (model.conv1, model.bn1, model.layer1):
                part.requires_grad_(False)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        if autocast:
            model = Autocast(model)
        batches = _images(2, 32, channels_last=channels_last)
        return Built(model, batches, _classify(10, batches), _sgd())

    return build


def _tv_mobilenet_v3() -> Built:
    """MobileNetV3 with the first four blocks of mobilenet_v3_small's setting (squeeze-excite,
    ReLU and hardswish blocks, a residual one): the full net costs 3x the time for no new op."""
    from torchvision.models.mobilenetv3 import InvertedResidualConfig, MobileNetV3

    torch.manual_seed(0)
    setting = [
        InvertedResidualConfig(16, 3, 16, 16, True, "RE", 2, 1, 1.0),
        InvertedResidualConfig(16, 3, 72, 24, False, "RE", 2, 1, 1.0),
        InvertedResidualConfig(24, 3, 88, 24, False, "RE", 1, 1, 1.0),
        InvertedResidualConfig(24, 5, 96, 40, True, "HS", 2, 1, 1.0),
    ]
    model = MobileNetV3(setting, last_channel=128, num_classes=10, dropout=0.0)
    batches = _images(2, 32)
    return Built(model, batches, _classify(10, batches), _sgd())


def _tv_convnext() -> Built:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    torch.manual_seed(0)
    setting = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, 64, 1), CNBlockConfig(64, None, 1)]
    model = ConvNeXt(setting, stochastic_depth_prob=0.0, num_classes=10)
    batches = _images(2, 32)
    return Built(model, batches, _classify(10, batches), _adamw())


def _tv_vit() -> Built:
    from torchvision.models import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=10,
    )
    batches = _images(2, 32)
    return Built(model, batches, _classify(10, batches), _adamw())


def _tv_swin() -> Built:
    from torchvision.models import SwinTransformer

    torch.manual_seed(0)
    model = SwinTransformer(
        patch_size=[2, 2],
        embed_dim=16,
        depths=[1, 2],  # the second stage's second block shifts its windows
        num_heads=[2, 4],
        window_size=[4, 4],
        stochastic_depth_prob=0.0,
        num_classes=10,
    )
    batches = _images(2, 16)
    return Built(model, batches, _classify(10, batches), _adamw())


# -- timm -----------------------------------------------------------------------------------------


def _timm(
    name: str, size: int, *, checkpointing: bool = False, channels_last: bool = False, **kwargs: Any
) -> Callable[[], Built]:
    def build() -> Built:
        import timm

        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        if checkpointing:
            model.set_grad_checkpointing(True)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        batches = _images(2, size, channels_last=channels_last)
        return Built(model, batches, _classify(10, batches), _adamw())

    return build


# -- transformers ---------------------------------------------------------------------------------

VOCAB, SEQ = 96, 8
_TINY = {"vocab_size": VOCAB}


def _tokens(batches: int = 2, n: int = 2, seq: int = SEQ) -> list[torch.Tensor]:
    return [torch.randint(0, VOCAB, (n, seq)) for _ in range(batches)]


def _causal_lm(
    config_name: str,
    config: dict[str, Any],
    *,
    attn: str = "sdpa",
    checkpointing: bool | None = None,  # None: off; True/False: use_reentrant
    autocast: bool = False,
    functional: bool = False,
    seq: int = SEQ,
):
    def build() -> Built:
        import transformers

        torch.manual_seed(0)
        cfg = getattr(transformers, config_name)(**_TINY, **config)
        model: nn.Module = transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation=attn
        )
        model.train()
        if checkpointing is not None:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": checkpointing}
            )
        if autocast:
            model = Autocast(model)
        if functional:
            model = FunctionalCall(model)
        batches = [{"input_ids": t, "labels": t} for t in _tokens(seq=seq)]
        return Built(model, batches, _hf_loss, _adamw())

    return build


_GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 16}
_GPT2 |= {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
_LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention
    "max_position_embeddings": 32,
    "tie_word_embeddings": True,
    "attention_dropout": 0.0,
}
_QWEN2 = {**_LLAMA}
_MISTRAL = {**_LLAMA, "sliding_window": 4}  # SEQ 8 > window: the window masks


def _bert_unused_pooler() -> Built:
    """BertModel with its pooler: a loss on the token states leaves the pooler without grad."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        **_TINY,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertModel(cfg, add_pooling_layer=True)
    model.train()
    batches = [
        {"input_ids": t, "attention_mask": torch.ones_like(t).index_fill_(1, torch.tensor([7]), 0)}
        for t in _tokens()
    ]

    def loss(out: Any, index: int) -> torch.Tensor:
        return out.last_hidden_state.pow(2).mean()

    return Built(model, batches, loss, _adamw())


def _t5() -> Built:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.T5Config(
        **_TINY,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(cfg)
    model.train()
    sources, targets = _tokens(), _tokens(seq=6)
    batches = [{"input_ids": s, "labels": t} for s, t in zip(sources, targets, strict=True)]
    return Built(model, batches, _hf_loss, _adamw())


def _hf_vit() -> Built:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=10,
    )
    model = transformers.ViTForImageClassification(cfg)
    model.train()
    pixels = [torch.randn(2, 3, 32, 32) for _ in range(2)]
    batches = [{"pixel_values": p, "labels": torch.randint(0, 10, (2,))} for p in pixels]
    return Built(model, batches, _hf_loss, _adamw())


# -- the zoo --------------------------------------------------------------------------------------

CASES: list[Case] = [
    # torchvision
    Case(
        "tv_resnet10_channels_last",
        "torchvision",
        "torchvision ResNet, BatchNorm in train mode, channels_last weights and input",
        _tv_resnet(channels_last=True),
    ),
    Case(
        "tv_resnet10_frozen_stem",
        "torchvision",
        "torchvision ResNet (1 block per stage), stem and layer1 frozen (fine-tuning)",
        _tv_resnet(frozen=True),
    ),
    Case(
        "tv_resnet10_autocast_bf16",
        "torchvision",
        "torchvision ResNet under CPU autocast bf16",
        _tv_resnet(autocast=True),
    ),
    Case("tv_mobilenet_v3_small", "torchvision", "MobileNetV3 (SE, hardswish)", _tv_mobilenet_v3),
    Case("tv_convnext", "torchvision", "ConvNeXt (LayerNorm2d, layer scale)", _tv_convnext),
    Case("tv_vit", "torchvision", "VisionTransformer (2 layers, hidden 32)", _tv_vit),
    Case("tv_swin", "torchvision", "Swin transformer (shifted windows)", _tv_swin),
    # timm (its own tiny test_* architectures)
    Case(
        "timm_test_vit_checkpointing",
        "timm",
        "timm test_vit, fused attention, grad checkpointing",
        _timm("test_vit", 32, checkpointing=True, img_size=32, patch_size=8, depth=2),
    ),
    Case(
        "timm_test_efficientnet",
        "timm",
        "timm test_efficientnet (depthwise, SE, BatchNorm)",
        _timm("test_efficientnet", 32),
    ),
    Case(
        "timm_test_convnext",
        "timm",
        "timm test_convnext channels_last",
        _timm("test_convnext", 32, channels_last=True),
    ),
    # transformers
    Case(
        "hf_gpt2_sdpa",
        "transformers",
        "GPT-2, sdpa attention, tied embeddings",
        _causal_lm("GPT2Config", _GPT2),
    ),
    Case(
        "hf_gpt2_eager_ckpt_reentrant",
        "transformers",
        "GPT-2, eager attention, gradient checkpointing (reentrant)",
        _causal_lm("GPT2Config", _GPT2, attn="eager", checkpointing=True),
    ),
    Case(
        "hf_gpt2_autocast_bf16",
        "transformers",
        "GPT-2 under CPU autocast bfloat16 (LayerNorm on the float32 residual stream)",
        _causal_lm("GPT2Config", _GPT2, autocast=True),
    ),
    Case(
        "hf_llama_sdpa",
        "transformers",
        "Llama, sdpa, GQA, tied embeddings",
        _causal_lm("LlamaConfig", _LLAMA),
    ),
    Case(
        "hf_llama_eager_ckpt",
        "transformers",
        "Llama, eager attention, gradient checkpointing (non-reentrant)",
        _causal_lm("LlamaConfig", _LLAMA, attn="eager", checkpointing=False),
    ),
    Case(
        "hf_llama_autocast_bf16",
        "transformers",
        "Llama under CPU autocast bfloat16 (RMSNorm)",
        _causal_lm("LlamaConfig", _LLAMA, autocast=True),
    ),
    Case(
        "hf_llama_functional_call",
        "transformers",
        "Llama through torch.func.functional_call",
        _causal_lm("LlamaConfig", _LLAMA, functional=True),
    ),
    Case(
        "hf_qwen2",
        "transformers",
        "Qwen2 (qkv bias), tied embeddings",
        _causal_lm("Qwen2Config", _QWEN2),
    ),
    Case(
        "hf_mistral_sliding_window",
        "transformers",
        "Mistral, sliding window 4 < sequence 8",
        _causal_lm("MistralConfig", _MISTRAL, attn="eager"),
    ),
    Case(
        "hf_bert_unused_pooler",
        "transformers",
        "BertModel, padding mask, pooler unused",
        _bert_unused_pooler,
    ),
    Case("hf_t5", "transformers", "T5 encoder-decoder, relative attention", _t5),
    Case("hf_vit", "transformers", "ViTForImageClassification", _hf_vit),
]

BY_NAME = {c.name: c for c in CASES}
