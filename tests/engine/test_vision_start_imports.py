"""A vision-language model's cold start imports only what it uses (issue 42): its image processor
is built without transformers' modeling machinery (multimodal/processor_import.py) and its tower
is built on meta without torch's Python references (loader/meta_build.quiet_meta), and the
processor still sees the real class where it checks one."""

from __future__ import annotations

import json

from tests.engine.test_start_imports import HEAVY, _run
from tests.engine.vision_gemma3_models import save_tiny_gemma3

MODELING = "transformers.modeling_utils"


def test_vision_language_start_to_first_token_imports_nothing_heavy(tmp_path):
    model = save_tiny_gemma3(str(tmp_path / "gemma3"))
    got = _run(
        """
        import json, sys
        import serverless_llm.worker.handler  # noqa: F401 - the worker's imports
        from PIL import Image
        from serverless_llm import LLM, SamplingParams
        HEAVY = json.loads(sys.argv[2])
        llm = LLM(sys.argv[1], device="cpu", num_kv_blocks=64, max_model_len=256)
        after_start = [m for m in HEAVY if m in sys.modules]
        processor = llm.engine.inputs.images.processor
        prompt = {"prompt": "Look: <start_of_image> what?",
                  "multi_modal_data": {"image": Image.new("RGB", (40, 30), (200, 10, 10))}}
        out = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0))
        print(json.dumps({"after_start": after_start,
                          "after_image": [m for m in HEAVY if m in sys.modules],
                          "processor": type(processor).__name__,
                          "outputs": len(out[0].outputs[0].token_ids)}))
        """,
        model,
        json.dumps([*HEAVY, MODELING]),
    )
    assert got["processor"] == "Gemma3Processor"
    assert got["outputs"] == 2
    assert got["after_start"] == [], got
    assert got["after_image"] == [], got  # an image request's processing too


def test_the_deferred_class_is_checked_as_the_real_one():
    got = _run(
        """
        import json, sys
        from serverless_llm.engine.multimodal.processor_import import (
            defer_modeling, modeling_imported)
        did = defer_modeling()
        from transformers import processing_utils
        stand_in = processing_utils.PreTrainedAudioTokenizerBase
        before = modeling_imported()
        checked = isinstance(object(), stand_in)  # imports the real module to answer
        from transformers.modeling_utils import PreTrainedAudioTokenizerBase as real

        class Tok(real):
            pass

        print(json.dumps({"did": did, "before": before, "after": modeling_imported(),
                          "plain": checked, "sub": issubclass(Tok, stand_in),
                          "real_module": type(sys.modules[sys.argv[1]]).__name__,
                          "again": defer_modeling()}))
        """,
        MODELING,
    )
    assert got["did"] is True and got["before"] is False
    assert got["plain"] is False and got["sub"] is True and got["after"] is True
    assert got["real_module"] == "module"  # the real one, not the stand-in
    assert got["again"] is False  # imported already: nothing to defer
