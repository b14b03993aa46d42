"""nsa-eval: Native Sparse Attention against full attention and sparse baselines."""

__version__ = "0.1.0"


def _register_lm_eval_model() -> None:
    """Make `nsa-eval` an lm-eval model name on `import nsa_eval`, lazily.

    The registry holds the string "nsa_eval.models.lm_adapter:NSAEvalLM" and imports it only when
    lm-eval looks the name up. lm-eval's own model names are registered first (lm_eval.models is a
    table of such strings), since lm-eval fills its registry only while it is empty. Cost: about
    0.1 s when lm-eval is installed; nothing when it is not.
    """
    try:
        import lm_eval.models  # noqa: F401
        from lm_eval.api.registry import model_registry
    except ImportError:
        return
    if "nsa-eval" not in model_registry:
        model_registry.register("nsa-eval", target="nsa_eval.models.lm_adapter:NSAEvalLM")


_register_lm_eval_model()
