"""Dynamic trees through Serve (``dynamic_trees``): with a hardware profile in the store the ingress sends each
grow the cost model's rule, the draft actor grows pruned trees, rank 0 verifies them as grown, and the greedy
text is the target alone's."""

from __future__ import annotations

import pytest
import requests

ray = pytest.importorskip("ray")

from sequoia_ray.config import SamplingParams  # noqa: E402
from sequoia_ray.hardware import HardwareProfile  # noqa: E402
from sequoia_ray.plan_store import PlanKey, PlanStore  # noqa: E402
from sequoia_ray.tree.acceptance_vector import AcceptanceVector  # noqa: E402
from sequoia_ray.tree.planning import plan_for  # noqa: E402
from tests.serving import BASE, complete, served_metadata, serving  # noqa: E402

pytestmark = pytest.mark.integration
HW = "test-dynamic-hw"
PROMPTS = ("the dynamic tree", "a second prompt, a little longer than the first")


def test_served_dynamic_trees_are_pruned_and_the_text_is_the_targets(store_dir, local):
    """A profile whose tree tokens cost little against a draft level (t(32) = 1.1, c = 0.5): the rule drops
    the tiny draft's unsure branches. Nodes verified per step (``usage.speculative.tree_nodes``) must fall
    below 0.8x what the plan's static trees verify in process on the same prompts."""
    store = PlanStore(str(store_dir))
    planned = plan_for(AcceptanceVector.from_p([0.8, 0.1, 0.05]), 16, 6)[0]
    store.publish_plan(planned, PlanKey(HW, "tiny-draft", "tiny-target", 0.0))
    store.publish_profile(HardwareProfile(HW, {1: 1.0, 32: 1.1}, {1: 0.5, 32: 0.6}, 0.1, 64, "float32"))
    app = {**BASE, "plan_store": str(store_dir), "hardware_id": HW, "dynamic_trees": True, "dynamic_extend": 2}
    served, static = [0, 0], [0, 0]  # tree nodes verified, steps
    with serving({"dyn": app}) as url:
        url = f"{url}/dyn"
        for prompt in PROMPTS:
            body = complete(url, prompt, max_tokens=32)
            ids = local.encode(prompt, chat=False)
            alone = local.decoder(planned.plan, speculate=False).generate(ids, SamplingParams(max_tokens=32))
            assert body["choices"][0]["text"] == alone.text, prompt
            spec = body["usage"]["speculative"]
            served = [served[0] + spec["tree_nodes"], served[1] + spec["steps"]]
            own = local.decoder(planned.plan).generate(ids, SamplingParams(max_tokens=32)).stats
            static = [static[0] + own.tree_nodes, static[1] + own.steps]
        meta = served_metadata(url)
    assert meta["dynamic_trees"]["profile"] and meta["dynamic_trees"]["extend"] == 2, meta
    assert served[0] / served[1] < 0.8 * static[0] / static[1], (served, static)
