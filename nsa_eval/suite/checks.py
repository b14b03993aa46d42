"""The checks a parsed suite passes before any model loads: every name and machine-dependent value.

`check_suite(suite)` checks methods and their parameters, checkpoints (through their config.json),
devices, backends, generation settings, the include_path files, task names, what a task's metadata
names on this machine (`MetadataKey.check_here`), that every prompt fits its model's context, the
opt-ins for tasks that execute model code, and the offline data; the first failure is a UsageError
naming the file and the key.
"""

from __future__ import annotations

import importlib.util
import os

from nsa_eval.errors import UsageError
from nsa_eval.models import loading
from nsa_eval.registry import unknown_name_message
from nsa_eval.suite.spec import UNBUDGETED, ModelSpec, Suite, TaskSpec
from nsa_eval.suite.task_index import check_include_path_files, check_shadowed_tasks, suite_task_manager
from nsa_eval.tasks.catalog import NIAH_GRID_DATASETS, metadata_schema, prompt_length_key
from nsa_eval.values import is_int

DEVICE_TYPES = ("cpu", "cuda", "mps")
SMOLLM2_LAYERS = 30  # SmolLM2-135M's layer count, when its converted config.json is not cached yet
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's when a task gives none (TaskConfig, HFLM and vLLM alike)

# Generation settings lm-eval reads itself (models/utils.py normalize_gen_kwargs); the rest go to
# transformers' generate (a GenerationConfig field) or vllm's SamplingParams.
LM_EVAL_GEN_KEYS = ("until", "max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens",
                    "do_sample", "temperature")


def check_suite(suite: Suite, *, check_tasks: bool = True, check_data: bool = True,
                device: str | None = None, runs_here: bool = True) -> list[str]:
    """Check every method, checkpoint, device, backend, generation setting and task name; raise
    UsageError on the first bad one. Returns warnings (one line each) that do not stop a run.

    Nothing loads: checkpoints are checked through their config.json, methods by building their
    parameter objects. Cheap checks run first; the task index (seconds: lm-eval scans its YAML
    files) runs last. `device` is `run --device` (it replaces every model's device). A device
    that does not parse is an error; one that this machine lacks (cuda with no GPU, cuda:3 on two
    GPUs) is an error when `runs_here` (run), and only a warning otherwise (validate, for a suite
    meant for another machine).
    """
    warnings: list[str] = []
    valid_methods = loading.attention_names()
    if device is not None:
        warnings += _check_device(device, "--device", runs_here)
    devices: dict[str, list[str]] = {}  # each device is checked once, named by its first entry
    for model in suite.models:
        if device is None and model.backend == "hf":  # vllm places itself on the GPUs
            devices.setdefault(model.device, []).append(model.label)
    for name, labels in devices.items():
        more = f" and {len(labels) - 1} more" if len(labels) > 1 else ""
        warnings += _check_device(name, f"{suite.path}: models (entry {labels[0]!r}{more}).device",
                                  runs_here)
    for model in suite.models:
        key = f"{suite.path}: models (entry {model.label!r})"
        if model.attention not in valid_methods:
            raise UsageError(f"{key}.attention: "
                             + unknown_name_message("attention method", model.attention, valid_methods))
        _check_checkpoint(model, key)
        _check_method_params(model, key)
        if model.backend == "vllm" and importlib.util.find_spec("vllm") is None:
            raise UsageError(f"{key}.backend: vllm is not installed here (pip install 'lm-eval[vllm]' "
                             "on a CUDA machine), so this entry cannot run; use backend: hf")
    for i, task in enumerate(suite.tasks):
        backends = {m.backend for m in suite.models if task.applies_to(m.label)}
        _check_gen_kwargs(task.gen_kwargs, backends, f"{suite.path}: tasks[{i}].gen_kwargs")
        _check_metadata_here(task, f"{suite.path}: tasks[{i}].metadata")
    warnings += check_include_path_files(suite)  # before lm-eval opens any of them
    if check_tasks:
        known = set(suite_task_manager(suite.include_path).all_tasks)
        for i, task in enumerate(suite.tasks):
            if task.task not in known:
                raise UsageError(f"{suite.path}: tasks[{i}].task: " + unknown_name_message(
                    "task", task.task, _close_names(task.task, known)))
        check_shadowed_tasks(suite)
        check_context_fits(suite)
        warnings += _check_unsafe_code(suite, runs_here)
    if check_data:
        warnings += _check_task_data(suite)
    return warnings


def _check_metadata_here(task: TaskSpec, where: str) -> None:
    """What the task's metadata names on this machine (NIAH's haystack folder), read as the task
    will read it, so a missing folder fails before any model loads."""
    schema = metadata_schema(task.task) or {}
    for name, value in task.metadata.items():
        if name in schema and schema[name].check_here is not None:
            schema[name].check_here(value, f"{where}.{name}")


# ---------------------------------------------------------------- models


def _check_device(device: str, key: str, runs_here: bool) -> list[str]:
    """UsageError for a device torch cannot parse; for one this machine lacks, an error when the
    suite runs here, else a warning."""
    import torch

    expected = "expected cpu, cuda, cuda:N or mps"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(f"{key}: {device!r} is not a device; {expected}") from None
    if parsed.type not in DEVICE_TYPES:
        raise UsageError(f"{key}: {device!r}: unsupported device type {parsed.type!r}; {expected}")
    problem = None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            problem = "no CUDA GPU is visible on this machine"
        elif parsed.index is not None and parsed.index >= count:
            problem = f"this machine has {count} CUDA GPU(s) (cuda:0 to cuda:{count - 1})"
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        problem = "MPS is not available on this machine"
    if problem is None:
        return []
    if runs_here:
        raise UsageError(f"{key}: {device!r}: {problem}; use --device cpu or run on a machine that "
                         "has it")
    return [f"{key}: {device!r}: {problem} (`run` here will stop; fine for a suite meant for "
            "another machine)"]


def _check_method_params(model: ModelSpec, key: str) -> None:
    """Build the method's parameter object as apply_attention will (`methods.validate_params`, its
    own code), so a typo in `params` or an impossible setting fails now rather than after the
    weights load."""
    if model.attention in UNBUDGETED:
        return
    from nsa_eval.methods import validate_params

    try:
        validate_params(model.attention, budget=model.budget, sink=model.sink, local=model.local,
                        sparse_prefill=model.sparse_prefill, dense_layers=model.dense_layers,
                        **model.params)
    except (UsageError, TypeError, ValueError) as err:
        raise UsageError(f"{key}.params: {err}") from None


def _check_checkpoint(model: ModelSpec, key: str) -> None:
    """The checkpoint exists and fits the attention method (read from config.json; no weights)."""
    try:
        if model.pretrained == "smollm2-135m":  # resolving it would convert the GGUF file (~40 s)
            from nsa_eval.models.smollm2 import gguf_path

            gguf_path()
            resolved = loading.Resolved(path=model.pretrained, kind="hf", model_type="llama")
        else:
            resolved = loading.inspect_checkpoint(model.pretrained)
            loading.check_builtin_model(resolved, causal_lm=model.backend == "hf")
        loading.check_attention(resolved, model.attention, model.budget or 0, model.sink or 0,
                                model.local or 0)
    except UsageError as err:
        raise UsageError(f"{key}.pretrained: {err}") from None
    if model.attention == loading.NSA_ATTENTION and model.params:
        try:
            loading.check_nsa_params(model.params, loading.nsa_checkpoint_config(resolved),
                                     where=str(model.pretrained))
        except UsageError as err:
            raise UsageError(f"{key}.params: {err}") from None
    if model.attention in UNBUDGETED:
        return
    config = _checkpoint_config(resolved)
    if config is not None and resolved.kind == "hf":  # the baselines run full-attention models only
        from nsa_eval.methods import check_model_config

        try:
            check_model_config(config)
        except UsageError as err:
            raise UsageError(f"{key}.attention: {err}") from None
    if model.dense_layers:
        layers = _layer_count(config, resolved)
        if layers is not None and model.dense_layers > layers:
            raise UsageError(f"{key}.dense_layers: {model.dense_layers} exceeds the {layers} layers of "
                             f"{model.pretrained}; expected at most {layers}")


def _checkpoint_config(resolved) -> dict | None:
    """A local checkpoint's config.json as a dict (None when it cannot be read, or not converted yet)."""
    if resolved.path == "smollm2-135m":
        from nsa_eval.models.smollm2 import converted_path

        directory = converted_path()
        return None if directory is None else loading.local_config(directory)
    return loading.local_config(resolved.path)


def _layer_count(config: dict | None, resolved) -> int | None:
    """num_hidden_layers from the checkpoint's config (None when it cannot be read)."""
    if config is None:
        return SMOLLM2_LAYERS if resolved.path == "smollm2-135m" else None
    layers = config.get("num_hidden_layers", (config.get("text_config") or {}).get("num_hidden_layers"))
    return layers if is_int(layers) else None


# ---------------------------------------------------------------- tasks


def _check_gen_kwargs(gen_kwargs: dict, backends: set[str], key: str) -> None:
    """Each generation setting is one lm-eval reads or one the backends' generate accepts."""
    if not gen_kwargs or not backends:
        return
    accepted: set[str] | None = set(LM_EVAL_GEN_KEYS)
    if "hf" in backends:
        from transformers import GenerationConfig

        accepted |= {k for k in GenerationConfig().to_dict() if not k.startswith("_")} - {
            "transformers_version"}
    if "vllm" in backends:
        try:
            import inspect

            from vllm import SamplingParams
        except ImportError:  # vllm entries fail their own check; accept what it might take
            accepted = None if backends == {"vllm"} else accepted
        else:
            accepted |= set(getattr(SamplingParams, "__struct_fields__", ())) or set(
                inspect.signature(SamplingParams).parameters)
    if accepted is None:
        return
    for name in gen_kwargs:
        if name not in accepted:
            import difflib

            close = difflib.get_close_matches(str(name), sorted(accepted), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"{key}.{name}: unknown generation setting {name!r}{hint}; expected one of "
                             f"lm-eval's {', '.join(LM_EVAL_GEN_KEYS)}, or a field of transformers' "
                             "GenerationConfig (top_p, top_k, repetition_penalty, ...)"
                             + (" or vllm's SamplingParams" if "vllm" in backends else ""))


def _close_names(name: str, known: set[str]) -> list[str]:
    """Up to a few suggestions instead of listing all ~15,000 lm-eval task names."""
    import difflib

    return difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.5) or ["(see `lm-eval ls tasks`)"]


def _check_unsafe_code(suite: Suite, runs_here: bool) -> list[str]:
    """A task that executes model-written code (lm-eval's `unsafe_code`, e.g. nsa_mbpp) runs only with
    both opt-ins, checked here rather than by lm-eval once the model has loaded. The entry's
    `confirm_run_unsafe_code: true` is the suite's; HF_ALLOW_CODE_EVAL=1 is the machine's, so like a
    missing GPU its absence is an error for `run` and a warning for `validate`."""
    from nsa_eval.tasks import requires_unsafe_code

    unsafe = set(requires_unsafe_code([t.task for t in suite.tasks], suite_task_manager(suite.include_path)))
    warnings = []
    for i, task in enumerate(suite.tasks):
        if task.task not in unsafe:
            continue
        if not task.confirm_run_unsafe_code:
            raise UsageError(f"{suite.path}: tasks[{i}].confirm_run_unsafe_code: {task.task} executes "
                             "model-written code to score it; expected confirm_run_unsafe_code: true on "
                             "this entry (and HF_ALLOW_CODE_EVAL=1), in a sandbox (docs/tasks.md)")
        if os.environ.get("HF_ALLOW_CODE_EVAL") != "1":
            problem = (f"{suite.path}: tasks[{i}] ({task.task}): executing model-written code also needs the "
                       "environment variable HF_ALLOW_CODE_EVAL=1 (it is "
                       f"{os.environ.get('HF_ALLOW_CODE_EVAL')!r})")
            if runs_here:
                raise UsageError(problem + "; set it where nsa-eval runs")
            warnings.append(problem + " (`run` here will stop)")
    return warnings


def _check_task_data(suite: Suite) -> list[str]:
    """Offline, missing data is a UsageError; online, a warning naming it (tasks.data)."""
    from nsa_eval.tasks.data import task_data_warnings

    return task_data_warnings([task.task for task in suite.tasks],
                              manager=suite_task_manager(suite.include_path))


# ---------------------------------------------------------------- context


def check_context_fits(suite: Suite) -> None:
    """Every generation task leaves its model room for a prompt, every NIAH prompt fits with what
    lm-eval adds around it and its answer, and so does a LongBench prompt cut to its own
    `longbench_max_length`. lm-eval stops at an assertion, after the model loaded,
    when max_gen_toks fills the context; and it cuts a long prompt with only a log warning (HFLM
    keeps its last max_length - max_gen_toks tokens; this adapter's `truncation: middle` drops its
    middle), so a NIAH cell would report a context length it never ran, perhaps without its needle.

    The context is the entry's `max_length`, else lm-eval's reading of a local checkpoint's files;
    a hub model, or a vllm entry (vLLM sizes its own context, rope scaling included), without
    `max_length` is not checked. The tokenizer loads only for a NIAH prompt within a few tokens of
    the limit, or one with a system instruction or a chat template."""
    from lm_eval.models.utils import normalize_gen_kwargs

    from nsa_eval.tasks.index import leaf_configs

    limits: dict[str, tuple[int, str] | None] = {}
    for model in suite.models:
        if model.max_length is not None:
            limits[model.label] = model.max_length, "its max_length"
        elif model.backend == "hf":
            limits[model.label] = loading.context_length(model.pretrained)
    manager = suite_task_manager(suite.include_path)
    for i, task in enumerate(suite.tasks):
        where = f"{suite.path}: tasks[{i}] ({task.label})"
        models = [m for m in suite.models if task.applies_to(m.label) and limits.get(m.label)]
        for _, cfg in leaf_configs([task.task], manager):
            if cfg.get("output_type") != "generate_until" or not models:
                continue
            # lm-eval's TaskConfig gives a generation task without generation_kwargs its defaults
            base = cfg.get("generation_kwargs") or {"max_gen_toks": DEFAULT_MAX_GEN_TOKS}
            settings = {**base, **task.gen_kwargs}
            try:
                answer = normalize_gen_kwargs(settings, DEFAULT_MAX_GEN_TOKS)["max_gen_toks"]
            except (TypeError, ValueError) as err:
                raise UsageError(f"{where}.gen_kwargs: {err}; expected numbers for max_gen_toks (or its "
                                 "aliases) and temperature") from None
            is_niah = str(cfg.get("custom_dataset", "")).endswith(NIAH_GRID_DATASETS)
            metadata = {**(cfg.get("metadata") or {}), **task.metadata}
            length_key = prompt_length_key(str(cfg.get("task", task.task)))
            for model in models:
                limit, origin = limits[model.label]
                if answer >= limit:
                    raise UsageError(f"{where} on models (entry {model.label!r}): max_gen_toks {answer} "
                                     f"leaves no room for a prompt in the {limit} tokens {model.pretrained} "
                                     f"takes ({origin}); expected max_gen_toks below {limit}, or a larger "
                                     "max_length on the model entry if the model runs longer inputs")
                if is_niah:
                    _check_niah_fit(f"{where} on models (entry {model.label!r})", task, model, metadata,
                                    answer, limit, origin)
                prompt = metadata.get(length_key) if length_key else None
                if is_int(prompt) and prompt + answer > limit:  # the model would cut it a second time
                    raise UsageError(f"{where} on models (entry {model.label!r}): {length_key} "
                                     f"{prompt} and max_gen_toks {answer} need {prompt + answer} tokens, but "
                                     f"{model.pretrained} takes {limit} ({origin}); expected "
                                     f"{length_key} up to {limit - answer}, or a larger max_length "
                                     "on the model entry if the model runs longer inputs")


def _check_niah_fit(where: str, task: TaskSpec, model: ModelSpec, metadata: dict, answer: int,
                    limit: int, origin: str) -> None:
    """UsageError when the longest NIAH prompt, its framing and `answer` new tokens overflow `limit`."""
    from jinja2 import TemplateError

    from nsa_eval.tasks import niah

    longest = max(niah.grid_lengths(metadata))
    room = limit - answer - longest
    measured = task.apply_chat_template or bool(task.system_instruction)
    if room >= 8 and not measured:  # no tokenizer adds 8 special tokens to a prompt
        return
    try:
        framing = niah.framing_tokens(niah.load_tokenizer(model.pretrained), chat=task.apply_chat_template,
                                      system_instruction=task.system_instruction,
                                      template=niah.grid_template(metadata))
    except (OSError, ValueError, TypeError, KeyError, TemplateError, UsageError) as err:
        # a tokenizer that cannot load, or has no chat template: the run would fail there too
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(f"{where}: cannot measure the NIAH prompt's framing with {model.pretrained}'s "
                         f"tokenizer ({reason})" + ("; expected a tokenizer with a chat template for "
                                                    "apply_chat_template: true" if task.apply_chat_template
                                                    else "")) from None
    if room >= framing:
        return
    added = (f" + about {framing} chat-template tokens" if task.apply_chat_template
             else f" + about {framing} tokens of system_instruction and special tokens"
             if task.system_instruction
             else f" + {framing} special token(s) its tokenizer adds" if framing else "")
    raise UsageError(
        f"{where}: a {longest}-token NIAH prompt{added} and max_gen_toks {answer} need "
        f"{longest + framing + answer} tokens, but {model.pretrained} takes {limit} ({origin}), and "
        f"lm-eval would cut the prompt without an error; expected niah_lengths up to "
        f"{limit - answer - framing}, a smaller max_gen_toks, or a larger max_length on the model entry "
        "if the model runs longer inputs")
