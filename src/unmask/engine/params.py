"""Per-request generation parameters, validated once at the boundary."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal

from unmask.decoding import PolicyConfig, SamplingParams
from unmask.decoding.edits import DEFAULT_POST_EDIT_STEPS, DEFAULT_REMASK_THRESHOLD, EditConfig
from unmask.decoding.dry import DEFAULT_BREAKERS, DryParams, validate as validate_dry
from unmask.decoding.logit_adjust import LogitAdjust, validate as validate_adjust
from unmask.decoding.policies import LEARNED, POLICIES, SPECULATIVE
from unmask.errors import InvalidRequestError
from unmask.structured.spec import StructuredSpec

POLICY_KNOBS = frozenset(f.name for f in fields(PolicyConfig)) - {"name"}  # what its error messages open with
TUNING_KNOBS = POLICY_KNOBS - {"empty_steps", "commit_filter"}  # set per request, not by the model's switches
# policies whose rule reads only the rows' confidences, not a per-block schedule: the ones that can take rows
# of two blocks at once (multi_block_threshold)
MULTI_BLOCK_POLICIES = ("threshold", "credit", "factor", "entropy_bounded", "topk")

# `policy` left at DEFAULT_POLICY: the model's own choice (generation_config.json `default_policy`, read by
# `model_policy`) where the request can run under it, else FALLBACK_POLICY, the engine's default before models
# named one; the engine resolves it (Engine.resolve_policy) before anything else reads the policy
DEFAULT_POLICY, FALLBACK_POLICY = "default", "threshold"
# what a model's `default_policy` may set (a request's own value wins where it has one)
MODEL_POLICY_KEYS = {"block_size": int, "draft_all_outcomes": bool, "draft_lookup": int}
# what a request may name with multi-block decoding or remasking (the default resolves to threshold with them)
UNSCHEDULED_POLICIES = (*MULTI_BLOCK_POLICIES, DEFAULT_POLICY)
# the most tokens a request may have copied as drafts in one step (each costs a verifier row of the forward)
MAX_DRAFT_LOOKUP = 64
CacheMode = Literal["auto", "none", "prefix", "dual"]
INTERACTIVE_PRIORITY, BATCH_PRIORITY = 0, 1


@dataclass
class GenerationParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    policy: str = DEFAULT_POLICY        # "default": the model's default policy (DEFAULT_POLICY above)
    threshold: float = 0.9
    steps: int | None = None            # denoising steps per block for schedule-based policies
    tokens_per_step: int | None = None  # the `topk` policy's fixed k (1 = one token per forward)
    factor: float = 1.0
    alg_temp: float = 0.0               # Dream: > 0 samples the committed rows from softmax(confidence / alg_temp)
    credit_decay: float = 0.8           # the credit policy's EMA decay, exponent and fusion weight (dInfer's values)
    credit_gamma: float = 0.2
    credit_weight: float = 0.7
    entropy_bound: float | None = None  # None: the default (0.35 for entropy_bounded; DiffusionGemma: 0.1)
    block_size: int | None = None       # None: the model's default
    small_block_size: int | None = None  # Fast-dLLM v2 sub-blocks: decode the block's leftmost masked slice only
    #                                      (None: the model's default, model_defaults(); the block size: off)
    # reference-fidelity switches (docs/decoding.md); None: the model's default (model_defaults())
    greedy_filters: bool | None = None   # at temperature 0, read confidences from the top_k / top_p-filtered softmax
    empty_steps: bool | None = None      # a schedule step may commit nothing (Dream's linear schedule)
    full_last_block: bool | None = None  # decode the last block at full size, cut the output at max_tokens after
    ordered_stops: bool | None = None    # commit a stop token only at the first undecided position (targets.py)
    multi_block_threshold: float | None = None  # D2F / d3LLM: decode the next block too once this share is committed
    # policy "speculative" (engine/speculative.py): a draft block for every number of drafts the verifier may keep,
    # not only for all of them (more tokens per forward, a wider forward); None: off
    draft_all_outcomes: bool | None = None
    # policy "speculative": also draft up to this many tokens copied from an earlier occurrence of the text's last
    # n-gram (prompt lookup; decoding.speculative.lookup_drafts); None or 0: off
    draft_lookup: int | None = None
    # policy "speculative", with draft_lookup: where the copy finds no earlier match, draft that many tokens from the
    # model's table of its training text's n-grams (decoding.ngram_drafts); None: on where the model has one
    draft_ngrams: bool | None = None
    # revising committed tokens of the active block (unmask.decoding.edits); all None: off, the tokens as before
    edit_threshold: float | None = None       # LLaDA2.1 token-to-token edits: replace when p(new token) > this
    max_post_edit_steps: int | None = None    # edit-only steps once the block is full (None: 16, SGLang's default)
    remask_budget: int | None = None          # ReMDM-style: low-confidence tokens put back to mask, per block
    remask_threshold: float | None = None     # ... when their own probability is below this (None: 0.5)
    cache: CacheMode = "auto"           # bidirectional families: none (exact) | prefix | dual
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0                 # no stop token or stop string ends the output before this many tokens
    ignore_eos: bool = False
    include_stop_str: bool = False
    snapshots: bool = False             # emit the active block each step (the `diffusing` view)
    logprobs: bool = False
    top_logprobs: int = 0               # with logprobs: the k most likely alternatives at each output position
    # OpenAI logit adjustments (unmask.decoding.logit_adjust): token id -> bias, and output-count penalties
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0     # vLLM / transformers: > 1 shrinks logits of prompt / output tokens
    # DRY loop penalty (unmask.decoding.dry), llama.cpp's server parameters and defaults; multiplier 0 = off
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] = field(default_factory=lambda: list(DEFAULT_BREAKERS))
    # uniform-noise families (DiffusionGemma); None: the checkpoint's generation_config, else the reference defaults
    t_min: float | None = None                 # temperature at the last denoising step
    t_max: float | None = None                 # temperature at the first denoising step
    stability_threshold: int | None = None     # steps the draft must stay unchanged before a canvas may stop
    confidence_threshold: float | None = None  # mean entropy under which a stable canvas stops
    uniform_draws: str = "reference"           # "reference": the reference's random stream; "lean": only used draws
    # structured output (unmask.structured): the output must match this grammar, enforced while decoding
    structured: StructuredSpec | None = None
    # scheduling: a waiting request with a lower value gets a free slot first (FIFO within a value); the server's
    # batch runner submits at BATCH_PRIORITY so that interactive requests (0) overtake its queued lines
    priority: int = 0
    # infilling (unmask.engine.infill), bidirectional families: tokens after the generated span, visible
    # at every step, and candidate span lengths probed in one batched forward (None: the span is max_tokens)
    suffix_ids: list[int] = field(default_factory=list)
    infill_lengths: list[int] | None = None

    def __post_init__(self):
        def bad(msg: str, param: str):
            raise InvalidRequestError(msg, param)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        for name in ("temperature", "top_p", "threshold", "factor"):  # before any comparison raises a TypeError
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                bad(f"{name} must be a number, got {value!r}", name)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            bad(f"top_k must be an integer, got {self.top_k!r}", "top_k")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64):
            bad(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}", "seed")
        if not 0.0 <= self.temperature <= 2.0:
            bad(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            bad(f"top_k must be >= 0, got {self.top_k}", "top_k")
        if self.block_size is not None and not 1 <= self.block_size <= 1024:
            bad(f"block_size must be in [1, 1024], got {self.block_size}", "block_size")
        if self.small_block_size is not None:
            s = self.small_block_size
            if not isinstance(s, int) or isinstance(s, bool) or s < 1:
                bad(f"small_block_size must be a positive integer, got {s!r}", "small_block_size")
            if self.block_size is not None:  # else the engine checks it against the model's block size
                self.check_small_block(self.block_size)
        if self.multi_block_threshold is not None:
            self.check_multi_block()
        lookup = self.draft_lookup
        if lookup is not None and (not isinstance(lookup, int) or isinstance(lookup, bool)
                                   or not 0 <= lookup <= MAX_DRAFT_LOOKUP):
            bad(f"draft_lookup must be an integer in [0, {MAX_DRAFT_LOOKUP}], got {lookup!r}", "draft_lookup")
        if self.draft_ngrams is not None and not isinstance(self.draft_ngrams, bool):
            bad(f"draft_ngrams must be true, false or null (the model's table where it has one), got "
                f"{self.draft_ngrams!r}", "draft_ngrams")
        self.check_edits()
        for name in REFERENCE_SWITCHES:
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                bad(f"{name} must be true, false or null (the model's default), got {value!r}", name)
        if self.cache not in ("auto", "none", "prefix", "dual"):
            bad(f"cache must be one of auto, none, prefix, dual; got {self.cache!r}", "cache")
        if isinstance(self.stop, str):  # one stop string, as the OpenAI API also takes it (not its characters)
            self.stop = [self.stop]
        if len(self.stop) > 4:
            bad("at most 4 stop sequences are allowed", "stop")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop sequences must be non-empty strings", "stop")
        if self.entropy_bound is not None and not self.entropy_bound >= 0:
            # the masked families' rule takes 0 (accept the single lowest-entropy position); DiffusionGemma's
            # reference refuses 0, which its own check says, so name both rules here
            bad(f"entropy_bound must be >= 0 (> 0 for DiffusionGemma), got {self.entropy_bound}", "entropy_bound")
        for name in ("t_min", "t_max"):
            v = getattr(self, name)
            if v is not None and not 0.0 <= v <= 100.0:
                bad(f"{name} must be in [0, 100], got {v}", name)
        if self.t_min is not None and self.t_max is not None and not self.t_max > self.t_min:
            bad(f"t_max ({self.t_max}) must be greater than t_min ({self.t_min})", "t_max")
        if self.stability_threshold is not None and (not isinstance(self.stability_threshold, int)
                                                     or isinstance(self.stability_threshold, bool)
                                                     or self.stability_threshold < 0):
            bad(f"stability_threshold must be an integer >= 0, got {self.stability_threshold!r}",
                "stability_threshold")
        if self.confidence_threshold is not None and not self.confidence_threshold > 0:
            bad(f"confidence_threshold must be > 0, got {self.confidence_threshold}", "confidence_threshold")
        if self.uniform_draws not in ("reference", "lean"):
            bad(f"uniform_draws must be 'reference' or 'lean', got {self.uniform_draws!r}", "uniform_draws")
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            bad("structured must be a StructuredSpec", "structured")
        if self.structured is not None and self.ignore_eos:
            bad("ignore_eos cannot be combined with a structured-output constraint (it ends at its grammar's end)",
                "ignore_eos")
        if self.structured is not None and self.min_tokens:  # a banned EOS where only EOS is grammatical: no token
            bad("min_tokens cannot be combined with a structured-output constraint (it ends at its grammar's end)",
                "min_tokens")
        if self.infill_lengths is not None:
            if (not isinstance(self.infill_lengths, (list, tuple)) or not self.infill_lengths
                    or not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= self.max_tokens
                               for n in self.infill_lengths)):
                bad(f"infill_lengths must be a non-empty list of integers in [1, max_tokens={self.max_tokens}], "
                    f"got {self.infill_lengths!r}", "infill_lengths")
            self.infill_lengths = sorted(set(self.infill_lengths))
        try:
            self.policy_config()
        except ValueError as e:  # PolicyConfig's messages open with the field's name
            name = str(e).split(" ", 1)[0]
            bad(str(e), name if name in POLICY_KNOBS else "policy")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
                "min_tokens")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            bad(f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs!r}", "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            bad("top_logprobs requires logprobs", "top_logprobs")
        problem = validate_adjust(self.logit_bias, self.presence_penalty, self.frequency_penalty,
                                  self.repetition_penalty)
        if problem:
            bad(problem, problem.split(" ", 1)[0])
        if not isinstance(self.dry_sequence_breakers, (list, tuple)):
            bad("dry_sequence_breakers must be a list of strings", "dry_sequence_breakers")
        problem = validate_dry(self.dry())
        if problem:
            bad(problem, problem.split(" ", 1)[0])

    def check_multi_block(self) -> None:
        t, name = self.multi_block_threshold, "multi_block_threshold"
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t <= 1:
            raise InvalidRequestError(f"{name} must be in (0, 1], got {t!r}", name)
        if self.small_block_size is not None:  # one narrows the candidates to a slice, the other widens them
            raise InvalidRequestError(f"{name} cannot be combined with small_block_size", name)
        if self.policy not in UNSCHEDULED_POLICIES:
            raise InvalidRequestError(f"{name} needs a policy without a per-block schedule "
                                      f"({', '.join(MULTI_BLOCK_POLICIES)}), not {self.policy!r}", name)
        if self.structured is not None:  # a grammar reads the committed text left to right, one block at a time
            raise InvalidRequestError(f"{name} cannot be combined with a structured-output constraint", name)

    def check_edits(self) -> None:
        """The revision fields (unmask.decoding.edits): ranges, and the options they cannot be combined with."""
        def bad(msg: str, name: str):
            raise InvalidRequestError(msg, name)

        def number(name: str, lo_open: bool) -> None:
            v = getattr(self, name)
            if v is None:
                return
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (0 < v <= 1 if lo_open else 0 <= v <= 1)
            if not ok:
                bad(f"{name} must be in {'(0, 1]' if lo_open else '[0, 1]'}, got {v!r}", name)

        def count(name: str, hi: int) -> None:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi):
                bad(f"{name} must be an integer in [0, {hi}], got {v!r}", name)

        number("edit_threshold", lo_open=False)
        number("remask_threshold", lo_open=True)
        count("max_post_edit_steps", 256)
        count("remask_budget", 1024)
        if self.max_post_edit_steps is not None and self.edit_threshold is None:
            bad("max_post_edit_steps needs edit_threshold (the edits it allows)", "max_post_edit_steps")
        if self.remask_threshold is not None and not self.remask_budget:
            bad("remask_threshold needs a remask_budget > 0", "remask_threshold")
        if not self.edit_config().active:
            return
        name = "edit_threshold" if self.edit_threshold is not None else "remask_budget"
        if self.multi_block_threshold is not None:  # edits stay inside one block: the one the cache is exact up to
            bad(f"{name} cannot be combined with multi_block_threshold", name)
        if self.structured is not None:  # a grammar reads the committed text once, left to right
            bad(f"{name} cannot be combined with a structured-output constraint", name)
        if self.remask_budget and self.policy not in UNSCHEDULED_POLICIES:  # a remask would upset a block schedule
            bad(f"remask_budget needs a policy without a per-block schedule ({', '.join(MULTI_BLOCK_POLICIES)}), "
                f"not {self.policy!r}", "remask_budget")

    def edit_config(self) -> EditConfig:
        return EditConfig(edit_threshold=self.edit_threshold,
                          max_post_edit_steps=(DEFAULT_POST_EDIT_STEPS if self.max_post_edit_steps is None
                                               else self.max_post_edit_steps),
                          remask_budget=self.remask_budget or 0,
                          remask_threshold=(DEFAULT_REMASK_THRESHOLD if self.remask_threshold is None
                                            else float(self.remask_threshold)))

    def check_model(self, block_size: int, block_causal: bool, causal_context: bool, family: str) -> None:
        """The block options against the model: `block_size` its default block, `block_causal` whether the
        family decodes block by block with the shared sequence class, `causal_context` whether its committed
        text attends token-causally (so two open blocks can form one group read over an exact cache)."""
        if self.full_last_block and not block_causal:
            raise InvalidRequestError(f"full_last_block needs a block-causal family, not {family}", "full_last_block")
        if self.small_block_size is not None:
            if not block_causal:
                raise InvalidRequestError(f"small_block_size needs a block-causal family, not {family}",
                                          "small_block_size")
            self.check_small_block(self.block_size or block_size)
        if self.multi_block_threshold is not None and not (block_causal and causal_context):
            raise InvalidRequestError("multi_block_threshold needs a block-causal model with a causal context "
                                      f"(`causal_context`, as the built-in model); this {family} model has none",
                                      "multi_block_threshold")

    def check_small_block(self, block_size: int) -> None:
        """small_block_size must split the block this request decodes with evenly."""
        s = self.small_block_size
        if s is not None and block_size % s:
            raise InvalidRequestError(f"small_block_size ({s}) must divide the block size ({block_size})",
                                      "small_block_size")

    def tunes_a_policy(self) -> bool:
        """Whether a knob of the mask-committing policies (threshold, steps, ...) is off its default: a request
        that tunes one without naming a policy means the policy those knobs belong to (FALLBACK_POLICY)."""
        return any(getattr(self, f.name) != f.default for f in fields(self) if f.name in TUNING_KNOBS)

    def with_model_policy(self, chosen: dict | None, allowed: bool) -> GenerationParams:
        """A copy with DEFAULT_POLICY resolved: the model's `chosen` default (model_policy) when `allowed` (the
        engine's check that this request can run under it) and no knob of another policy is tuned, else
        FALLBACK_POLICY. The request's own block size etc. win over the model's."""
        if self.policy != DEFAULT_POLICY:
            return self
        if not chosen or not allowed or self.tunes_a_policy():
            return replace(self, policy=FALLBACK_POLICY)
        kw = {k: v for k, v in chosen.items() if k != "policy" and getattr(self, k) is None}
        return replace(self, policy=chosen["policy"], **kw)

    def policy_config(self) -> PolicyConfig:
        name = FALLBACK_POLICY if self.policy == DEFAULT_POLICY else self.policy  # unresolved: the fallback's rule
        return PolicyConfig(name=name, threshold=self.threshold, steps=self.steps, factor=self.factor,
                            entropy_bound=0.35 if self.entropy_bound is None else self.entropy_bound,
                            tokens_per_step=self.tokens_per_step, alg_temp=self.alg_temp,
                            credit_decay=self.credit_decay, credit_gamma=self.credit_gamma,
                            credit_weight=self.credit_weight, empty_steps=bool(self.empty_steps))

    def logit_adjust(self) -> LogitAdjust:
        bias = tuple(sorted((int(t), float(v)) for t, v in (self.logit_bias or {}).items() if v))
        return LogitAdjust(bias, float(self.presence_penalty), float(self.frequency_penalty),
                           float(self.repetition_penalty))

    def dry(self) -> DryParams:
        return DryParams(float(self.dry_multiplier), float(self.dry_base), self.dry_allowed_length,
                         self.dry_penalty_last_n, tuple(self.dry_sequence_breakers))

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              greedy_filters=bool(self.greedy_filters))

    def resolved(self, defaults: dict, block_size: int) -> GenerationParams:
        """A copy with the model's defaults (`model_defaults`) in the fields this request left at None.

        `block_size` is the model's. The default `small_block_size` applies only where it divides the block
        this request decodes with and no `multi_block_threshold` is set (a default never makes a request
        invalid). With `greedy_filters` on, a greedy request that sets neither top_k nor top_p (0 / 1.0) takes
        the model's (Dream's diffusion_generate reads them from its generation config)."""
        kw = {}
        for name in REFERENCE_SWITCHES:
            if getattr(self, name) is None:
                kw[name] = bool(defaults.get(name, False))
        sub = defaults.get("small_block_size")
        if self.small_block_size is None and sub and self.multi_block_threshold is None:
            if (self.block_size or block_size) % sub == 0:
                kw["small_block_size"] = sub
        filters = kw.get("greedy_filters", self.greedy_filters)
        if filters and self.temperature == 0 and self.top_k == 0 and self.top_p == 1.0:
            kw.update({k: defaults[k] for k in ("top_k", "top_p") if k in defaults})
        return replace(self, **kw) if kw else self


# switches whose default is the model's (a family default, or a bool of the same name in generation_config.json)
REFERENCE_SWITCHES = ("greedy_filters", "empty_steps", "full_last_block", "ordered_stops")

# Each family's reference sampler, where the engine's own defaults differ from it (docs/decoding.md, "Reference
# fidelity"); a checkpoint's generation_config.json may set the same keys (and Dream's top_k / top_p) itself.
#   Fast-dLLM v2: `generate(..., block_size=32, small_block_size=8)` (families.md 4.4), its scripts too.
#   Dream: `diffusion_generate` filters by top_p / top_k before reading confidences, also at temperature 0, and
#   its linear schedule int(M * (1 - s/t)) may give a step no token (families.md 2.5).
#   unmask (the built-in family): stop tokens in order (decoding/targets.py): its SFT rows pad with EOS in the
#   loss, so a masked block's tail is confidently EOS; committed first it emptied 6 of 119 held-out infills
#   (docs/decoding.md, "Stop tokens in order"). The public families keep their references' commit order.
FAMILY_DEFAULTS: dict[str, dict] = {
    "unmask": {"ordered_stops": True},
    "fast_dllm_v2": {"small_block_size": 8},
    "dream": {"greedy_filters": True, "empty_steps": True},
}


def model_defaults(family: str, generation_config: dict) -> dict:
    """The request defaults a model's reference sampler implies: FAMILY_DEFAULTS[family], overridden by the
    same keys in its generation_config.json (values of the wrong type there are ignored)."""
    out = dict(FAMILY_DEFAULTS.get(family, {}))
    gc = generation_config if isinstance(generation_config, dict) else {}
    for name in REFERENCE_SWITCHES:
        if isinstance(gc.get(name), bool):
            out[name] = gc[name]
    sub = gc.get("small_block_size")
    if sub is None or (isinstance(sub, int) and not isinstance(sub, bool) and sub >= 1):
        out["small_block_size"] = sub if "small_block_size" in gc else out.get("small_block_size")
    if out.get("greedy_filters"):
        k, p = gc.get("top_k"), gc.get("top_p")
        if isinstance(k, int) and not isinstance(k, bool) and k >= 0:
            out["top_k"] = k
        if isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1:
            out["top_p"] = float(p)
    return out


def model_policy(generation_config: dict) -> dict | None:
    """The model's default decoding (generation_config.json `default_policy`, e.g. {"policy": "speculative",
    "block_size": 4}) as request fields, or None; keys of the wrong type are ignored, as elsewhere in this file."""
    gc = generation_config if isinstance(generation_config, dict) else {}
    cfg = gc.get("default_policy")
    if not isinstance(cfg, dict) or cfg.get("policy") not in (*POLICIES, LEARNED, SPECULATIVE):
        return None
    out = {"policy": cfg["policy"]}
    for key, kind in MODEL_POLICY_KEYS.items():
        v = cfg.get(key)
        if isinstance(v, kind) and not (kind is not bool and isinstance(v, bool)):
            out[key] = v
    return out


PENALTY_KEYS = ("presence_penalty", "frequency_penalty", "repetition_penalty",
                "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers")


def sampling_defaults(generation_config: dict, chat: bool = False) -> dict:
    """The model's own sampling settings (generation_config.json) for fields a request leaves out:
    temperature / top_p / top_k when it samples (`do_sample`), and its presence / frequency penalties
    (OpenAI-style keys), `repetition_penalty` (the transformers key) and the DRY settings (llama.cpp's
    keys; `dry_sequence_breakers` too). With `chat`, the penalties under
    `chat_defaults` override those: chat answers and raw completions want different settings (a frequency
    penalty ends chat answers but breaks code, docs/model-card.md), and one generation_config key cannot say so."""
    def penalties(cfg) -> dict:
        cfg = cfg if isinstance(cfg, dict) else {}
        out = {k: cfg[k] for k in PENALTY_KEYS if isinstance(cfg.get(k), (int, float))}
        if isinstance(cfg.get("dry_sequence_breakers"), list):
            out["dry_sequence_breakers"] = list(cfg["dry_sequence_breakers"])
        return out

    out = penalties(generation_config)
    if chat:
        out.update(penalties(generation_config.get("chat_defaults")))
    if generation_config.get("do_sample"):
        out.update({k: generation_config[k] for k in ("temperature", "top_p", "top_k")
                    if generation_config.get(k) is not None})
    return out
