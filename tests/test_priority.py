"""Request priority in the engine's scheduler: a waiting interactive request (priority 0) is admitted before
batch requests (BATCH_PRIORITY) that were queued earlier; within a priority, first come first served; running
batch requests sit out the steps while an interactive one runs, and decode the same tokens after."""
from __future__ import annotations

from unmask.engine.llm import LLM
from unmask.engine.params import BATCH_PRIORITY, GenerationParams


def admission_order(engine, arrivals: dict[int, list[tuple[str, int]]]) -> list[str]:
    """Run the engine to completion; `arrivals[step]` = requests (name, priority) added before that step.
    Returns names in the order they first ran."""
    names, order, step = {}, [], 0
    while arrivals or engine.has_unfinished():
        for name, priority in arrivals.pop(step, []):
            seq = engine.add_request([5, 6, 7, 8], GenerationParams(max_tokens=8, priority=priority))
            names[seq.request_id] = name
        engine.step()
        for seq in engine.scheduler.running:
            if names[seq.request_id] not in order:
                order.append(names[seq.request_id])
        step += 1
    return order


def test_interactive_request_overtakes_a_full_batch_queue(family_dirs):
    engine = LLM(family_dirs["sdar"], max_num_seqs=2).engine
    batch = [(f"b{i}", BATCH_PRIORITY) for i in range(6)]
    order = admission_order(engine, {0: batch, 1: [("chat", 0)]})
    # b0, b1 took the two slots at step 0; the chat request, queued behind b2..b5, gets the next free slot
    assert order[:2] == ["b0", "b1"] and order[2] == "chat", order
    assert order[3:] == ["b2", "b3", "b4", "b5"]


def test_equal_priorities_are_first_come_first_served(family_dirs):
    engine = LLM(family_dirs["sdar"], max_num_seqs=2).engine
    order = admission_order(engine, {0: [(f"r{i}", 0) for i in range(5)], 2: [("late", 0)]})
    assert order == ["r0", "r1", "r2", "r3", "r4", "late"]


def test_waiting_interactive_requests_come_first_at_admission(family_dirs):
    engine = LLM(family_dirs["sdar"], max_num_seqs=2).engine
    order = admission_order(engine, {0: [("b0", BATCH_PRIORITY), ("b1", BATCH_PRIORITY), ("chat", 0)]})
    assert order[:2] == ["chat", "b0"] and order[2] == "b1"


def test_running_batch_requests_pause_while_an_interactive_one_runs(family_dirs):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    batch_params = GenerationParams(max_tokens=24, priority=BATCH_PRIORITY)
    reference = LLM(family_dirs["sdar"], max_num_seqs=4).engine
    ref_seqs = [reference.add_request(p, batch_params) for p in prompts]
    reference.run_to_completion()

    engine = LLM(family_dirs["sdar"], max_num_seqs=4).engine
    seqs = [engine.add_request(p, batch_params) for p in prompts]
    engine.step()
    engine.step()
    forwards = [s.stats.forwards for s in seqs]
    chat = engine.add_request([12, 13, 14], GenerationParams(max_tokens=16))
    while chat.finish_reason is None:
        engine.step()
        assert [s.stats.forwards for s in seqs] == forwards   # paused: not in the interactive request's forwards
    assert chat.stats.forwards > 0 and all(s.finish_reason is None for s in seqs)
    engine.run_to_completion()
    # a pause changes nothing in what a batch request decodes
    assert [s.output_ids for s in seqs] == [s.output_ids for s in ref_seqs]


def test_background_slots_keep_slots_free_for_interactive_requests(family_dirs):
    engine = LLM(family_dirs["sdar"], max_num_seqs=4).engine
    engine.scheduler.background_slots = 2
    batch = [engine.add_request([5, 6, 7, i], GenerationParams(max_tokens=8, priority=BATCH_PRIORITY))
             for i in range(8, 14)]
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == [s.request_id for s in batch[:2]]
    chat = engine.add_request([12, 13, 14], GenerationParams(max_tokens=8))
    engine.step()
    assert chat in engine.scheduler.running and len(engine.scheduler.running) == 3
    engine.run_to_completion()
    assert all(s.finish_reason == "length" for s in batch + [chat])
