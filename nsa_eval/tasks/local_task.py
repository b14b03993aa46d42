"""`LocalFirstTask`: an lm-eval task that reads $NSA_EVAL_DATA before the hub (see local_data.py).

The project's YAMLs select it with `class: !function nsa_eval.tasks.local_task.LocalFirstTask`;
lm-eval indexes a YAML with a `class` key as a task, so a group sets it on each member entry.
"""

from __future__ import annotations

from lm_eval.api.task import ConfigurableTask

from nsa_eval.errors import UsageError
from nsa_eval.tasks.code_execution import require_code_eval_opt_in
from nsa_eval.tasks.local_data import hub_offline, load_local, missing_data_message, spec_from_config


class LocalFirstTask(ConfigurableTask):
    """A ConfigurableTask whose download() prefers the local JSONL files of its hub dataset."""

    def __init__(self, data_dir=None, cache_dir=None, download_mode=None, config=None):
        # `class` selected this type; it is not a TaskConfig field.
        config = {k: v for k, v in (config or {}).items() if k != "class"}
        super().__init__(data_dir, cache_dir, download_mode, config=config)

    def download(self, dataset_kwargs=None, **kwargs) -> None:
        spec = spec_from_config(self.config)
        if spec is None:  # custom_dataset or an explicit local file: nothing to redirect
            return super().download(dataset_kwargs, **kwargs)
        if not spec.missing():
            self.dataset = load_local(spec)
            return None
        if hub_offline():
            raise UsageError(missing_data_message({spec.task: spec.missing()}, [spec.task]))
        return super().download(dataset_kwargs, **kwargs)


class CodeExecutionTask(LocalFirstTask):
    """A LocalFirstTask that scores by running model-written code (MBPP, HumanEval): it refuses to
    build without the code-execution opt-in, so nothing is generated that could not be scored."""

    def __init__(self, data_dir=None, cache_dir=None, download_mode=None, config=None):
        require_code_eval_opt_in()
        super().__init__(data_dir, cache_dir, download_mode, config=config)
