"""`MTPModel`: a Hugging Face causal LM plus draft heads, with exact self-speculative `generate()`.

The wrapper owns nothing of the base model's computation: it calls the base model as transformers
built it (its cache classes, 4D masks and position ids) and adds heads on the final hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .adaptive import LADDER, PRIOR_COST, AdaptiveDraft, half_precision_prior
from .arch import BaseInfo, describe
from .checkpoint import (
    apply_heads_state,
    base_fingerprint,
    base_probe,
    load_heads_state,
    save_heads,
)
from .config import MTPConfig
from .decoding import (
    GenerateOutput,
    GreedyStrategy,
    SamplingStrategy,
    check_generation_config,
    resolve_stopping,
    speculative_generate,
)
from .draft_vocab import DraftProjection
from .dynamic_tree import DYNAMIC_DEPTH, DYNAMIC_WIDTH, DynamicTree
from .eagle import select_features
from .files import share_weights
from .heads import build_heads
from .proposer import MedusaProposer, Proposer
from .sampling import SamplingParams
from .tree import Tree, build_tree, resolve_tree


@dataclass
class MTPOutput:
    logits: torch.Tensor  # (B, T, V) base next-token logits
    head_logits: torch.Tensor | None  # (K, B, T, V): head k at position t guesses token t+k+2
    hidden_states: torch.Tensor  # (B, T, d) final hidden state (input of lm_head)


class MTPModel(nn.Module):
    """A base causal LM with K draft heads. Build with `from_base` or `from_pretrained`."""

    def __init__(self, base_model: nn.Module, heads: nn.Module, config: MTPConfig):
        super().__init__()
        self.base_model = base_model
        self.heads = heads
        self.config = config
        self.info: BaseInfo = describe(base_model)
        self.tokenizer = None  # optional; saved alongside the checkpoint when set
        self.draft_vocab: torch.Tensor | None = None  # see set_draft_vocab
        object.__setattr__(self, "_draft_projection", None)  # a cache, not a submodule
        self._verify_forward: Any = None  # see compile_decoding
        object.__setattr__(self, "_packed", None)  # (base, heads) with packed weights: see pack_decoding
        self.train(base_model.training)  # inherit the base's mode: eval() bases stay dropout-free

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_base(
        cls,
        base_model: nn.Module,
        num_heads: int = 4,
        head_type: str = "medusa",
        tree: Any = None,
        tree_nodes: int = 16,
        **head_kwargs: Any,
    ) -> MTPModel:
        """Fresh heads on `base_model`, in its dtype and on its device, starting equal to its lm_head."""
        info = describe(base_model)
        heads = build_heads(
            head_type,
            base_model=base_model,  # used only by head types that declare `needs_base` (MTP modules)
            hidden_size=info.hidden_size,
            vocab_size=info.vocab_size,
            num_heads=num_heads,
            **head_kwargs,
        )
        param = next(base_model.parameters())
        heads.to(device=param.device, dtype=param.dtype)
        init = getattr(heads, "init_from_base", None)
        if init is not None:
            init(base_model.get_output_embeddings())
        config = MTPConfig(
            head_type=head_type,
            num_heads=num_heads,
            head_kwargs=heads.config_kwargs(),
            hidden_size=info.hidden_size,
            vocab_size=info.vocab_size,
            base_model_type=info.model_type,
            base_architectures=list(info.architectures),
            base_model_name_or_path=getattr(base_model, "name_or_path", None) or None,
            tree=[list(p) for p in resolve_tree(tree, num_heads, Tree([])).paths] if tree is not None else None,
            tree_nodes=tree_nodes,
        )
        return cls(base_model, heads, config)

    @classmethod
    def from_pretrained(
        cls,
        path_or_dir: str | Path,
        torch_dtype: torch.dtype | str | None = None,
        device_map: Any = None,
        base_model: nn.Module | None = None,
    ) -> MTPModel:
        """Load a full or heads-only checkpoint. `base_model=` overrides the base the config points to."""
        directory = Path(path_or_dir)
        if not directory.is_dir():
            raise FileNotFoundError(f"MTP checkpoint directory not found: {directory}")
        config = MTPConfig.load(directory)
        state, probe, draft_vocab = load_heads_state(directory)
        if base_model is None:
            base_model = _load_base(directory, config, torch_dtype, device_map)
        info = describe(base_model)
        if (info.hidden_size, info.vocab_size) != (config.hidden_size, config.vocab_size):
            raise ValueError(
                f"heads in {directory} were built for hidden size {config.hidden_size} / vocab "
                f"{config.vocab_size}, but the base model has {info.hidden_size} / {info.vocab_size}"
            )
        heads = build_heads(
            config.head_type,
            base_model=base_model,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            num_heads=config.num_heads,
            **config.head_kwargs,
        )
        apply_heads_state(heads, base_model, state, probe, directory)
        param = next(base_model.parameters())
        heads.to(device=param.device, dtype=param.dtype)
        model = cls(base_model, heads, config)
        if draft_vocab is not None:
            model.set_draft_vocab(draft_vocab)
        return model

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Draft only from these token ids (see mtp.draft_vocab); None drafts from the whole vocabulary.

        Output never changes (the base verifies with its full lm_head); drafting gets cheaper, and a
        draft is lost where the base picks a token outside the set. Saved with the heads.

        Heads with a draft vocabulary of their own (the EAGLE drafter: its `lm_head` over `draft_ids`,
        trained on exactly those tokens) refuse one here: restricting their drafts again would silently
        contradict what they were trained to project onto. Set theirs with `model.heads.set_draft_vocab`.
        """
        own = getattr(self.heads, "draft_ids", None)
        if token_ids is not None and own is not None:
            raise ValueError(
                f"{getattr(self.heads, 'head_type', type(self.heads).__name__)!r} heads draft from their own "
                f"{own.numel()}-token vocabulary (heads.draft_ids, saved with their weights); a model-level draft "
                "vocabulary does not apply to them: choose theirs before training, with "
                "model.heads.set_draft_vocab(ids, base_model) (it copies the base lm_head's rows)"
            )
        if token_ids is not None:
            token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().cpu()
            if token_ids.numel() == 0 or int(token_ids.min()) < 0 or int(token_ids.max()) >= self.info.vocab_size:
                raise ValueError(f"draft vocabulary ids must be non-empty and in 0..{self.info.vocab_size - 1}")
            token_ids = torch.unique(token_ids)
        self.draft_vocab = token_ids
        object.__setattr__(self, "_draft_projection", None)

    def save_pretrained(self, directory: str | Path, heads_only: bool = False) -> Path:
        """Write heads (+ the base unless `heads_only`) as safetensors, plus `mtp_config.json`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        probe = base_probe(self.base_model)
        self.config.base_checksum = base_fingerprint(probe)
        if not heads_only:
            self.base_model.save_pretrained(directory)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(directory)
        save_heads(self.heads, directory, probe, self.draft_vocab)
        self.config.save(directory)
        share_weights(directory)
        return directory

    # ---- training forward ---------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        with_heads: bool = True,
        **kwargs: Any,
    ) -> MTPOutput:
        """Base logits and head logits at every position (for training and evaluation)."""
        out = self.base_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **kwargs)
        hidden = out.hidden_states[-1]
        head_logits = None
        if with_heads:
            # what the heads observe: the final hidden state, or the fused layer inputs of an EAGLE drafter
            feats = select_features(out.hidden_states, getattr(self.heads, "feature_layers", None))
            head_logits = self.heads(feats, self.base_model.get_output_embeddings(), input_ids=input_ids)
        return MTPOutput(logits=out.logits, head_logits=head_logits, hidden_states=hidden)

    # ---- decoding -----------------------------------------------------------------------------

    @property
    def default_tree(self) -> Tree:
        if self.config.tree is not None:
            return Tree(self.config.tree)
        return build_tree(self.config.tree_nodes, self.config.num_heads, self.config.head_accuracies)

    def make_proposer(self) -> Proposer:
        """The drafter for one generate() call; each head type brings its own (`heads.make_proposer`)."""
        heads = self._packed[1] if self._packed is not None else self.heads
        base = self.decoding_base
        lm_head = base.get_output_embeddings()
        if self.draft_vocab is not None:
            proj, own = self._draft_projection, self.base_model.get_output_embeddings()
            if proj is None or proj.weight.dtype != own.weight.dtype or proj.weight.device != own.weight.device:
                proj = DraftProjection(own, self.draft_vocab)
                if self._packed is not None:
                    proj = proj.to_packed()
                object.__setattr__(self, "_draft_projection", proj)
            lm_head = proj
        make = getattr(heads, "make_proposer", None)
        if make is not None:
            return make(base, lm_head=lm_head)
        return MedusaProposer(heads, lm_head)

    def compile_decoding(self, warmup: bool = True, **options: Any) -> MTPModel:
        """Run every verify step through a compiled forward of the base (`mtp.compiled`); returns self.

        On a CPU this makes a verify step cheaper than an eager one-token step (fused kernels; see
        `mtp.compiled` for the numbers). Graphs are built on first use, a few minutes on 2 cores, so by
        default they are built here (`warmup`), before the first request. `options` go to `torch.compile`
        (`dynamic=True` unless given). Training, `forward()` and the prompt's forward stay eager.
        """
        from .compiled import compile_forward, warm_up

        self._verify_forward = compile_forward(self.base_model, **options)
        if warmup:
            was_training = self.training
            self.eval()
            try:
                warm_up(self._verify_forward, self.base_model, self.info, self.default_tree)
            finally:
                self.train(was_training)
        return self

    def pack_decoding(self) -> MTPModel:
        """Decode from weights prepacked for the CPU's matmul kernels (`mtp.packed`); returns self.

        On a CPU the verify forward, the prompt's forward and drafting all get cheaper (SmolLM2 bf16: a
        9-node verify step ~43 -> ~32 ms), with no compile step. It costs a second copy of the linear
        weights, and it is a snapshot: call it again after changing the weights. Training, `forward()`
        and `base_model.generate()` keep using the model's own weights.
        """
        from .attention import use_grouped_sdpa
        from .packed import packed_copy

        # the heads' one-row calls may leave bf16's own kernel (no reference to match bit for bit), the base's not
        heads = packed_copy(self.heads, own_one_row=False)
        base = packed_copy(self.base_model)
        use_grouped_sdpa(base)  # the copy has a config of its own: the model's generate() keeps plain sdpa
        object.__setattr__(self, "_packed", (base, heads))
        object.__setattr__(self, "_draft_projection", None)
        return self

    @property
    def decoding_base(self) -> nn.Module:
        """The base that decoding runs: the packed copy after `pack_decoding`, else the model's own."""
        return self._packed[0] if self._packed is not None else self.base_model

    @property
    def packed(self) -> bool:
        """Whether decoding runs from prepacked weights (`pack_decoding`)."""
        return self._packed is not None

    @property
    def compiled(self) -> bool:
        """Whether verify steps run through a compiled forward (`compile_decoding`)."""
        return self._verify_forward is not None

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        eos_token_id: int | list[int] | None = None,
        attention_mask: torch.Tensor | None = None,
        tree: Any = None,
        streamer: Any = None,
        return_dict_in_generate: bool = False,
        speculative: bool = True,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        generator: torch.Generator | None = None,
        acceptance: str = "lossless",
        typical_epsilon: float = 0.09,
        typical_delta: float = 0.3,
        prompt_lookup: bool = True,
    ) -> torch.Tensor | GenerateOutput:
        """What `base_model.generate(...)` would return, produced several tokens per forward.

        Greedy (`do_sample=False`, the default unless the model's generation_config says otherwise):
        token-identical output. Sampling: exactly the distribution generate() samples from (same
        warpers: temperature, top_k, top_p, min_p), via lossless speculative sampling; the same
        `generator` seed gives the same output. `acceptance="typical"` switches to Medusa's typical
        acceptance, which is faster but LOSSY: an explicit opt-in, never the default.

        tree: None / "auto" (adaptive: the tree size, down to no drafting at all, that gives the most
        tokens per second for this text, up to the model's default tree; in greedy decoding with a drafter
        that can, each tree is grown at draft time where the drafter is confident: `mtp.dynamic_tree`),
        "auto-static" (the same policy with static tree shapes), "default" (the default tree, fixed), "chain",
        an int (node budget for a built tree), a `Tree`, a list of rank paths, or a `DynamicTree` (a fixed
        draft-time budget; greedy only).
        `speculative=False` decodes one token per step with the same code path (the baseline the
        speedup is measured against, and a per-request off switch).
        prompt_lookup: also draft by copying what followed the last occurrence of the current n-gram in
        the prompt and output (mtp.ngram), verified in the same forward as the heads' tree (under sampling
        as point-mass drafts, so the distribution stays exact).
        """
        input_ids = _check_input(input_ids, attention_mask)
        gen_config = self.base_model.generation_config
        check_generation_config(gen_config)
        if do_sample is None:
            do_sample = bool(getattr(gen_config, "do_sample", False))
        strategy = GreedyStrategy()
        if do_sample:
            params = SamplingParams.resolve(gen_config, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
            strategy = SamplingStrategy(params, generator, acceptance, typical_epsilon, typical_delta)
        elif acceptance != "lossless":
            raise ValueError("acceptance='typical' only applies to sampling (do_sample=True)")
        max_new, eos = resolve_stopping(
            gen_config,
            input_ids.shape[1],
            max_new_tokens,
            eos_token_id,
            getattr(self.base_model.config, "max_position_embeddings", None),
        )
        if self.info.max_positions is not None and input_ids.shape[1] + max_new > self.info.max_positions:
            raise ValueError(
                f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new}) exceeds the model's "
                f"{self.info.max_positions} positions"
            )
        proposer = self.make_proposer()
        dynamic = None
        if not speculative:
            step_tree = Tree([])
        elif tree is None or tree in ("auto", "auto-static"):
            # The default: adaptive drafting up to the model's default tree size, seeded with its accuracies.
            # No wall-clock input where the tree decides the output: under sampling (which random numbers a
            # step draws) and in half precision (how the verify forward rounds at near-ties), so the same
            # call gives the same tokens on a busy machine as on a quiet one. In half precision the choice is
            # only the full default tree or no drafting at all: the default tree's size is already the one
            # that measured fastest on development prompts (bench/tree_sweep.py), and it keeps its shape
            # (reshaped ones measured slower: 2.09x vs 2.17x, MT-Bench 80).
            param = next(self.base_model.parameters())
            half = param.dtype in (torch.bfloat16, torch.float16)
            default = self.default_tree  # built from the config on each access: once per call
            full = len(default)
            step_tree = AdaptiveDraft(
                self.config.num_heads,
                full,
                self.config.head_accuracies,
                prior_cost=half_precision_prior(param.device, param.dtype, self.packed) if half else PRIOR_COST,
                timed=not (do_sample or half),
                ladder=(1, full) if half else LADDER,
                shapes={full: default} if half else None,
                depth_cost=proposer.depth_cost,
            )
            if proposer.dynamic_trees and not do_sample and tree != "auto-static":
                # the policy picks how many nodes; the drafter's confidence shapes them (mtp.dynamic_tree)
                dynamic = DynamicTree(full, DYNAMIC_DEPTH, DYNAMIC_WIDTH)
        elif isinstance(tree, DynamicTree):
            if not proposer.dynamic_trees:
                raise ValueError(f"{self.config.head_type!r} heads draft static trees only; pass a Tree or None")
            step_tree = tree
        else:
            step_tree = resolve_tree(tree, self.config.num_heads, self.default_tree)
        was_training = self.training
        self.eval()
        try:
            result = speculative_generate(
                self.decoding_base,
                self.info,
                proposer,
                input_ids,
                step_tree,
                max_new,
                eos,
                streamer,
                strategy,
                prompt_lookup=prompt_lookup and speculative,
                forward=self._verify_forward,
                dynamic=dynamic,
            )
        finally:
            self.train(was_training)
        return result if return_dict_in_generate else result.sequences


def _check_input(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a 2D LongTensor of shape (1, prompt_length)")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"batch size {input_ids.shape[0]} is not supported: self-speculative generate() takes one "
            "sequence at a time (call it per prompt)"
        )
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give at least one prompt token")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape")
        if not bool(attention_mask.all()):
            raise ValueError("attention_mask has padding; pass the unpadded prompt (batch size 1 needs none)")
    return input_ids


def _load_base(directory: Path, config: MTPConfig, torch_dtype: Any, device_map: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if (directory / "config.json").is_file():
        source = directory
    elif config.base_model_name_or_path == "default":  # the embedded SmolLM2 (mtp.default_model)
        from .default_model import default_model_dir

        source = default_model_dir()
    elif config.base_model_name_or_path:
        source = Path(config.base_model_name_or_path)
        if not source.exists():
            raise FileNotFoundError(
                f"heads-only checkpoint {directory} points at base model {source}, which does not exist; "
                "pass base_model= to from_pretrained"
            )
    else:
        raise ValueError(
            f"{directory} holds heads only and records no base model path; pass base_model= to from_pretrained"
        )
    kwargs: dict[str, Any] = {"use_safetensors": True} if any(Path(source).glob("*.safetensors")) else {}
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    if device_map is not None:
        kwargs["device_map"] = device_map
    return AutoModelForCausalLM.from_pretrained(str(source), **kwargs).eval()
