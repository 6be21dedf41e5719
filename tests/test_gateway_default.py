"""The main job as shipped: `calm serve` with no options (in-process vLLM, embedded model, the bundled CALM
artifact), through the official `openai` client. Multiple-choice confidence is cloze option scoring through the
artifact's LoRA weights and α head, checked against HF transformers + peft (fp32, 1e-3)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from adapters.hosting.core_share import team_size
from adapters.hosting.cpu_limits import usable_cpus
from calm_core.data import load_mc
from calm_core.prompts import cloze_prompt
from tests.hf_reference import cloze_option_probs
from tests.servers import background, calm_argv, free_port, http, metric_values, wait_until, watch_start
from tests.test_cli import calm

# memory_gb: the peak PSS of a gateway with three engines, `calm eval` offline beside it: 8.1 GB measured with the
# tests' 128 MB KV cache per engine (9.8 with the CPU default 512; tests/memory_budget.py).
pytestmark = [pytest.mark.slow, pytest.mark.memory_gb(9.0)]
MODEL = "calm-smollm2-135m"


@pytest.fixture(scope="module")
def started(tmp_path_factory, embedded_model_dir):
    """The gateway, watched from its launch until it serves an answer (tests/servers.py watch_start)."""
    tmp = tmp_path_factory.mktemp("default-gateway")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp / "gateway.log"
    # As `make serve` runs: no OMP_NUM_THREADS (the suite sets 1; empty is unset to OpenMP and to the gateway).
    env = {"CALM_DB_PATH": str(tmp / "gw.sqlite3"), "OMP_NUM_THREADS": ""}
    with background(calm_argv("serve", "--port", str(port)), log, env) as proc:
        rounds = watch_start(base, proc, log)
        yield {"base": base, "rounds": rounds, "log": log, "db": tmp / "gw.sqlite3", "pid": proc.pid}


@pytest.fixture(scope="module")
def gateway(started):
    return started["base"]


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120)


def test_each_engine_core_runs_one_gloo_loop_thread(started):
    """vLLM's 13 gloo groups of an engine core share one TCP device (adapters/hosting/gloo_device.py), whose loop thread
    wakes every 10 ms: torch's own way would run 13 (tests/test_engine_processes.py shows both in one process)."""
    import psutil

    from tests.test_engine_processes import gloo_loop_threads

    loops = {}
    for process in psutil.Process(started["pid"]).children(recursive=True):
        try:
            loops[process.pid] = gloo_loop_threads(process.pid)
        except OSError:  # a short-lived helper that ended meanwhile
            continue
    cores = {pid: n for pid, n in loops.items() if n}
    assert len(cores) == 3 and set(cores.values()) == {1}, cores


def test_the_engine_cores_fork_from_a_server_the_gateway_forked_after_its_imports(started):
    """No second interpreter imports torch and vLLM for the engines: their server is the gateway's own fork
    (adapters/hosting/engine_server_fork.py), with the gateway's command line and the name calm-engines."""
    import psutil

    from adapters.hosting.engine_processes import SERVER_NAME

    gateway = psutil.Process(started["pid"])
    descendants = gateway.children(recursive=True)
    servers = [p for p in descendants if p.name() == SERVER_NAME and p.ppid() == gateway.pid]
    assert len(servers) == 1 and servers[0].cmdline() == gateway.cmdline(), [(p.pid, p.name()) for p in descendants]
    assert len([p for p in descendants if p.ppid() == servers[0].pid]) == 3  # adapter, folded, free_form
    assert not [p for p in descendants if "multiprocessing.forkserver" in " ".join(p.cmdline())]
    assert "importing vLLM for the gateway and its engine-core server" in started["log"].read_text()


def calibration(choice) -> dict:
    return choice.model_extra["calibration"]


def test_ready_flips_to_200_exactly_when_the_first_answer_is_served(started):
    """`calm serve` listens at once: live 200 while ready and every answer are 503 "starting" (with Retry-After);
    /health/ready turns 200 together with the answers, never before or after them."""
    rounds = started["rounds"]
    starting = [r for r in rounds if r["live"] == 200 and r["answer"] == 503]
    assert starting, rounds[:5]  # the server answered long before its engines had started
    assert all(r["answer_error"] == "starting" and r["retry_after"] for r in starting)
    assert all(r["ready_before"] == 503 for r in starting)
    for r in rounds:
        assert r["answer"] in (None, 200, 503), r
        if r["ready_before"] == 200:
            assert r["answer"] == 200, r  # ready means an answer can be served
        if r["ready_after"] == 503:  # (the answer may have been refused before the server listened: None)
            assert r["answer"] != 200, r  # and an answer means ready
    assert rounds[-1]["answer"] == 200 and rounds[-1]["ready_after"] == 200
    log = started["log"].read_text()
    for line in ("starting 3 vLLM engines", "engine 'folded' answers", "engine 'free_form' answers",
                 f"ready on {started['base']} after"):
        assert line in log, line


def test_the_shipped_artifact_is_served_by_one_pass_scoring(gateway):
    health = http.get(f"{gateway}/health", headers={"Authorization": "Bearer dev-admin-key"}).json()
    assert health["scoring"]["multiple_choice"].startswith("cloze one-pass:"), health["scoring"]
    assert "prefix cache" in health["scoring"]["multiple_choice"], health["scoring"]


def test_the_engines_share_the_cores_step_by_step(started):
    """Nothing set: each engine sizes its OpenMP team before every step to its share of the usable cores among the
    engines computing then (adapters/hosting/core_share.py): the one-pass engine alone (raw pass off) runs on every core, a
    multiple-choice question's two passes at once on half each (benchmarks/results/engine_threads.md)."""
    base, cpus = started["base"], usable_cpus()

    def teams() -> dict:
        share = http.get(f"{base}/health", headers={"Authorization": "Bearer dev-admin-key"}).json()["engine"]["core_share"]
        assert share["cpus"] == cpus
        return share["teams"]

    def ask(raw: bool) -> None:
        r = http.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Which planet is largest?"}],
            "options": ["Mars", "Jupiter", "Venus", "Mercury"], "calm": {"raw_confidence": raw}})
        assert r.status_code == 200, r.text

    engine = http.get(f"{base}/health", headers={"Authorization": "Bearer dev-admin-key"}).json()["engine"]
    assert engine["threads"] is None and engine["omp_wait_policy"] == "PASSIVE"
    assert ("starting 3 vLLM engines (adapter, folded, free_form), OpenMP teams sized every step to a share of "
            f"{cpus} cores (OMP_WAIT_POLICY=PASSIVE)") in started["log"].read_text()
    for _ in range(20):  # until the engines busy before this test have gone quiet
        ask(raw=False)
        if teams()["folded"] == cpus:
            break
    assert teams()["folded"] == cpus
    half = team_size(cpus, busy=2)
    seen = set()
    # Rounds of 24 questions, 8 at a time, until a step of each engine has started while the other computed. Whether a
    # round shows it depends on the scheduling: a pass counts as busy for 0.2 s after its step, and on a loaded machine
    # each round's one-pass steps could all start first, in gaps longer than that (seen once: only (1, 2) in a round).
    # Engines that never halve their teams still fail after the last round.
    with ThreadPoolExecutor(8) as pool:
        for _ in range(10):
            questions = [pool.submit(ask, True) for _ in range(24)]
            while not all(q.done() for q in questions):  # the teams while both passes compute
                now = teams()
                seen.add((now["adapter"], now["folded"]))
                time.sleep(0.05)
            [q.result() for q in questions]
            if (half, half) in seen:
                break
    assert (half, half) in seen, seen


def test_shipped_artifact_is_a_trained_calm_head_on_cloze(shipped_artifact):
    m, head = shipped_artifact.manifest, shipped_artifact.head
    assert m.method == "calm_scalar" and m.answer_format == "cloze" and m.has_adapter
    assert abs(float(np.mean(head.scale)) - 1.0) > 0.1  # training moved the head away from identity
    assert {"science", "commonsense", "medicine"} <= set(m.reference_histograms)


def test_default_gateway_scores_options_by_cloze_through_the_shipped_head(client, gateway, shipped_artifact, shipped_model,
                                                                          shared_data):
    from tests.hf_reference import option_tolerances

    model, tokenizer = shipped_model
    head = shipped_artifact.head
    atol, raw_atol = option_tolerances(gateway)  # 1e-3 in fp32 (CPU); the bf16 budget where the engine runs bf16 (GPU)
    questions = [q for q in load_mc("arc_easy", "test", root=shared_data) if q.n_options == 4][:5]
    # One question long enough (a cache block, 128 tokens on CPU) for the later options to read it from vLLM's prefix
    # cache; short enough to keep HF's reference cheap.
    questions += [q for q in load_mc("mmlu", "test", root=shared_data) if q.n_options == 4 and 160 <= len(
        tokenizer(cloze_prompt(q.question), add_special_tokens=False)["input_ids"]) <= 200][:1]
    moved = 0
    for q in questions:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q.question}],
                                           extra_body={"options": list(q.choices)}, metadata={"domain": "science"})
        cal = calibration(r.choices[0])
        expected = cloze_option_probs(model, tokenizer, q.question, q.choices, head.scale, head.shift)
        raw = cloze_option_probs(model, tokenizer, q.question, q.choices)
        chosen = "ABCD".index(r.choices[0].message.content)
        assert cal["mode"] == "multiple_choice" and chosen == int(np.argmax(expected))
        np.testing.assert_allclose([o["probability"] for o in cal["options"]], expected, atol=atol)
        assert cal["confidence"] == pytest.approx(expected[chosen], abs=atol)
        assert cal["raw_confidence"] == pytest.approx(raw[chosen], abs=raw_atol)
        moved += abs(cal["confidence"] - cal["raw_confidence"]) > 0.01
    assert moved >= 3  # the trained head changes the confidence inside the engine


def test_options_written_in_the_prompt_are_scored_the_same_way(client):
    explicit = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Which gas do plants absorb?"}],
                                              extra_body={"options": ["oxygen", "carbon dioxide", "helium"]})
    text = "Which gas do plants absorb?\nA. oxygen\nB. carbon dioxide\nC. helium\nAnswer with a letter."
    written = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}])
    completion = client.completions.create(model=MODEL, prompt="Which gas do plants absorb?", max_tokens=1,
                                           extra_body={"options": ["oxygen", "carbon dioxide", "helium"]})
    probs = [[o["probability"] for o in calibration(c)["options"]]
             for c in (explicit.choices[0], written.choices[0], completion.choices[0])]
    np.testing.assert_allclose(probs[1], probs[0], atol=1e-6)
    np.testing.assert_allclose(probs[2], probs[0], atol=1e-6)
    assert explicit.usage.completion_tokens == 0 and explicit.usage.prompt_tokens > 10


def test_shipped_artifact_serves_free_form_answers_with_its_own_calm_mode(shipped_artifact):
    mode = shipped_artifact.free_form
    assert mode is not None and mode is not shipped_artifact and shipped_artifact.manifest.free_form_version
    assert mode.manifest.answer_format == "generative" and mode.manifest.method.startswith("calm")
    assert {"trivia", "entity_knowledge"} <= set(shipped_artifact.manifest.reference_histograms)


# Plain prompts the base model answers correctly (greedy): the free-form mode must keep them right.
PLAIN = {"What is the capital of France?": "Paris", "What is the capital of Japan?": "Tokyo",
         "What is the chemical symbol for water?": "H2O", "Who painted the Mona Lisa?": "Leonardo da Vinci"}


def test_free_form_token_confidence_equals_hf_through_the_free_form_mode(client, free_form_model, shared_data):
    """A free-form answer's confidence is the geometric mean of its tokens' calibrated probabilities under the
    free-form mode (adapter + α head), end-of-turn token included; raw_confidence the same without the head. Both
    equal a hand computation with HF transformers + peft (1e-3), greedy text and token log-probs included; plain
    prompts keep a correct answer."""
    from calm_core.data import load_open
    from tests.hf_reference import greedy_free_form

    model, tokenizer, head = free_form_model
    questions = list(PLAIN) + [q.question for q in load_open("triviaqa", root=shared_data)[2400:2403]]
    moved = 0
    for question in questions:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                           max_tokens=48, logprobs=True, extra_body={"calm": {"raw_confidence": True}})
        choice, cal = r.choices[0], calibration(r.choices[0])
        assert cal["mode"] == "free_form" and cal["method"] == "token"
        answer, calibrated, raw = greedy_free_form(model, tokenizer, question, head.scale, head.shift)
        assert choice.message.content == tokenizer.decode(answer, skip_special_tokens=True)
        served = [t.logprob for t in choice.logprobs.content]  # greedy through the order-keeping head: calibrated
        np.testing.assert_allclose(served, calibrated[: len(served)], atol=1e-3)
        assert cal["confidence"] == pytest.approx(float(np.exp(np.mean(calibrated))), abs=1e-3)
        assert cal["raw_confidence"] == pytest.approx(float(np.exp(np.mean(raw))), abs=1e-3)
        moved += abs(cal["confidence"] - cal["raw_confidence"]) > 0.01
        if question in PLAIN:
            assert PLAIN[question] in choice.message.content
    assert moved >= 3  # the free-form head changes the confidence inside the engine


def test_a_free_form_answers_confidence_is_the_same_however_it_was_sampled(client, gateway):
    """The same answer gets the same confidence (1e-6) greedy, at temperature 0.3, with top_p 0.01 and with top_k 1,
    and a threshold policy decides the same for all: no sampling parameter can walk an answer past it (on the
    previous path the answer below got 0.39, 0.83, 1.0 and 1.0). Multiple-choice confidence ignores them too."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    sampling = [{}, {"temperature": 0.3, "seed": 1}, {"temperature": 1.0, "top_p": 0.01, "seed": 1},
                {"temperature": 1.0, "seed": 1, "extra_body": {"top_k": 1}}]
    ask = lambda: [client.chat.completions.create(model=MODEL, messages=question, max_tokens=24, **s).choices[0]  # noqa: E731
                   for s in sampling]
    choices = ask()
    answers = {c.message.content for c in choices}
    confidences = [calibration(c)["confidence"] for c in choices]
    assert len(answers) == 1 and "Paris" in answers.pop()
    assert max(confidences) - min(confidences) < 1e-6 and confidences[0] < 0.9, confidences
    admin = {"Authorization": "Bearer dev-admin-key"}
    policy = http.put(f"{gateway}/admin/policies/other", json={"threshold": 0.9, "action": "abstain"}, headers=admin)
    assert policy.status_code == 200, policy.text
    try:
        assert all(calibration(c)["abstained"] for c in ask())
    finally:
        assert http.delete(f"{gateway}/admin/policies/other", headers=admin).status_code in (200, 204)
    options = {"options": ["Paris", "Lyon", "Nice", "Lille"]}
    mc = [calibration(client.chat.completions.create(model=MODEL, messages=question, extra_body=options, **t
                                                     ).choices[0])["confidence"]
          for t in ({}, {"temperature": 0.3, "seed": 1}, {"temperature": 1.5, "seed": 2})]
    assert max(mc) - min(mc) < 1e-6, mc


def test_sampled_answers_are_the_models_own_draws_each_with_the_confidence_its_text_gets(client, free_form_model):
    """At temperature 0.8 the answers are drawn from the served weights without the head (the head flattens on purpose,
    and drawing through it gave noise): the log-probs each token was drawn with are the weights' own at 0.8 (HF
    teacher forcing, 1e-3), the same seed giving the same texts; each answer's confidence is its own text's, read back
    through the head at temperature 1 (1e-3)."""
    from tests.hf_reference import free_form_logprobs

    model, tokenizer, head = free_form_model
    question = "What is the capital of France?"
    ask = lambda: client.chat.completions.create(  # noqa: E731
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0.8, n=4, seed=7,
        logprobs=True).choices
    first, again = ask(), ask()
    assert [c.message.content for c in first] == [c.message.content for c in again]
    for choice in first:
        ids = tokenizer(choice.message.content, add_special_tokens=False).input_ids
        ids += [tokenizer.eos_token_id] * (choice.finish_reason == "stop")  # the end of turn counts as a token
        assert len(ids) == len(choice.logprobs.content), choice.message.content
        calibrated, drawn = free_form_logprobs(model, tokenizer, question, ids, head.scale, head.shift, 0.8)
        assert calibration(choice)["confidence"] == pytest.approx(float(np.exp(np.mean(calibrated))), abs=1e-3)
        np.testing.assert_allclose([t.logprob for t in choice.logprobs.content], drawn, atol=1e-3)


def test_semantic_confidence_keeps_the_greedy_answer_and_maps_the_share_of_agreeing_samples(client, shipped_artifact):
    """Semantic mode answers exactly what token mode answers (Hamlet, the capitals and the other plain prompts); its
    confidence is the shipped free-form mode's fitted map of the share of raw samples that agree (raw_confidence)."""
    semantic = shipped_artifact.free_form.manifest.semantic
    assert semantic is not None and semantic.fitted_on.startswith("labels (alias match), 200 questions of triviaqa")
    for question in ["Who wrote Hamlet?", *PLAIN]:
        ask = lambda **calm: client.chat.completions.create(  # noqa: E731
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0,
            extra_body={"calm": calm}).choices[0]
        token, sem = ask(), ask(confidence="semantic", samples=8, raw_confidence=True)
        cal = calibration(sem)
        assert sem.message.content == token.message.content, question
        assert cal["method"] == "semantic" and sum(c["size"] for c in cal["clusters"]) == 8
        agreeing = round(cal["raw_confidence"] * 8)
        assert cal["confidence"] == pytest.approx(semantic.confidence(agreeing, 8), abs=1e-9)
        if question in PLAIN:
            assert PLAIN[question].lower() in sem.message.content.lower()


def test_sampled_answers_follow_the_seed(client):
    ask = lambda seed: client.chat.completions.create(  # noqa: E731
        model=MODEL, messages=[{"role": "user", "content": "Which is a mammal?"}], temperature=2.0, seed=seed,
        extra_body={"options": ["shark", "whale", "trout", "eel"]}).choices[0]
    answers = {seed: ask(seed).message.content for seed in range(8)}
    assert all(ask(seed).message.content == answers[seed] for seed in (0, 1))
    assert len(set(answers.values())) > 1  # at temperature 2 the draw is not always the most probable option


def test_seeded_answers_in_a_batch_prefilled_in_chunks_keep_the_engine_and_follow_their_seed(client, gateway):
    """Twelve seeded answers to ~240-token prompts at once: more prompt than an engine step takes (2,048 tokens), which
    vLLM prefilled in chunks, and a seeded request prefilled in chunks killed the CPU engine ("CPU Generator does not
    use offset"; the gateway's engine then stayed dead: every request 503). Now each prompt is prefilled in one step
    (adapters/hosting/engine_settings.py, CPU_CHUNKED_PREFILL): every answer comes back, each the same as its request sent
    alone, and the gateway stays ready. The prompts' length fits the tests' 128 MB cache, where a longer prompt's
    chunk found no free block and was not scheduled at all."""
    filler = "The quick brown fox jumps over the lazy dog. " * 20
    ask = lambda i: client.chat.completions.create(  # noqa: E731
        model=MODEL, messages=[{"role": "user", "content": f"Note {i}. {filler}Which animal jumps?"}], max_tokens=8,
        temperature=0.8, seed=i).choices[0]
    with ThreadPoolExecutor(12) as pool:
        batched = list(pool.map(ask, range(12)))
    assert all(c.finish_reason in ("stop", "length") and c.message.content for c in batched)
    assert [ask(i).message.content for i in (0, 11)] == [batched[0].message.content, batched[11].message.content]
    assert http.get(f"{gateway}/health/ready", timeout=30).status_code == 200


def _chat_requests(gateway: str) -> float:
    return sum(metric_values(gateway, "calm_requests_total", endpoint="chat"))


# `calm eval` runs in this process (tests/test_cli.py's `calm`, typer's runner) where only its numbers are compared:
# each run in a subprocess paid 6-7 CPU-s for importing torch and transformers again. The offline free-form
# evaluation stays a subprocess: it starts vLLM in process, which this one must not host.


def test_calm_eval_offline_equals_calm_eval_through_the_gateway(gateway, tmp_path, shipped_artifact):
    """`calm eval --artifact` (HF transformers: base + merged adapter, cloze, α head) and `calm eval --gateway`
    (the official client against the running default gateway) give the same option probabilities (1e-3) and the
    same report; an interrupted gateway run resumes without asking again what it already has."""
    import json

    from tests.hf_reference import option_tolerances

    atol, _ = option_tolerances(gateway)
    sets = ["eval", "-d", "arc_easy:dev", "-d", "medmcqa", "--limit", "6"]
    offline = calm(*sets, "--artifact", shipped_artifact.path, "--out", tmp_path / "offline")
    assert offline.returncode == 0, offline.stderr
    online_cmd = [*sets, "--gateway", gateway, "--concurrency", "4", "--out", tmp_path / "online"]
    online = calm(*online_cmd)
    assert online.returncode == 0, online.stderr
    for name in ("arc_easy_dev", "medmcqa_dev"):
        a, b = (np.load(tmp_path / run / f"probs_{name}.npz") for run in ("offline", "online"))
        assert list(a["question_ids"]) == list(b["question_ids"]) and (a["labels"] == b["labels"]).all()
        np.testing.assert_allclose(b["probs"], a["probs"], atol=atol)
    reports = [json.loads((tmp_path / run / "report.json").read_text()) for run in ("offline", "online")]
    for label in ("arc_easy:dev", "medmcqa:dev"):
        assert reports[1]["results"][label]["accuracy"] == reports[0]["results"][label]["accuracy"]
        assert reports[1]["results"][label]["ece_10"] == pytest.approx(reports[0]["results"][label]["ece_10"], abs=atol)
    assert reports[1]["artifact"] == shipped_artifact.manifest.artifact_version
    # Interrupted: two answers lost and a line cut in half. The rerun asks exactly the two missing questions.
    answers = tmp_path / "online" / "answers_medmcqa_dev.jsonl"
    kept = answers.read_text().splitlines()[:4]
    answers.write_text("\n".join(kept) + "\n" + '{"id": "cut')
    before = _chat_requests(gateway)
    again = calm(*online_cmd)
    assert again.returncode == 0, again.stderr
    assert _chat_requests(gateway) - before == 2 + 1  # the two missing answers, and the deployment probe
    rerun = np.load(tmp_path / "online" / "probs_medmcqa_dev.npz")
    np.testing.assert_allclose(rerun["probs"], np.load(tmp_path / "offline" / "probs_medmcqa_dev.npz")["probs"], atol=atol)


# 8 TriviaQA questions (the comparison with the gateway below) and the 6 of PopQA's test range 0-0.006 (the report's
# checks), each set whole under --limit 8: one offline run, one vLLM start, for both tests. --samples 3 gives the
# semantic checks their samples; the greedy answers the gateway comparison reads come first and are not changed by them.
FREE_FORM_SETS = ["-d", "triviaqa", "-d", "popqa:test@0-0.006", "--limit", "8"]


@pytest.fixture(scope="module")
def offline_free_form(tmp_path_factory, shipped_artifact):
    """`calm eval --artifact` of the shipped artifact's free-form mode on both sets (vLLM in its own process): the
    report folder and the run's stderr."""
    import subprocess

    out = tmp_path_factory.mktemp("offline-free-form")
    proc = subprocess.run([*calm_argv("eval", *FREE_FORM_SETS, "--samples", "3", "--artifact",
                                      str(shipped_artifact.path), "--out", str(out))],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stderr


def test_free_form_eval_of_the_shipped_mode_writes_a_report(offline_free_form, shipped_artifact):
    """`calm eval --artifact` on open-ended sets answers through the artifact's free-form mode (vLLM, as served):
    accuracy, token and semantic confidence per set; a range of a split selects the questions a domain split would.
    (Moved from tests/test_cli.py, its errors still there: its run is the one the gateway comparison below reads.)"""
    import json

    out, stderr = offline_free_form
    report = json.loads((out / "report.json").read_text())
    assert report["artifact"] == shipped_artifact.manifest.free_form_version
    m = report["results"]["popqa:test@0-0.006"]
    assert m["n"] == 6 and 0 < m["mean_confidence"] < 1 and 0 < m["sem_mean_confidence"] < 1
    assert m["sem_same_answer"] == 1.0 and m["sem_accuracy"] == m["accuracy"]  # semantic keeps the greedy answer
    answers = [json.loads(line) for line in (out / "answers_popqa_test_0-0.006.jsonl").read_text().splitlines()]
    assert all(sum(a["cluster_sizes"]) == 3 and 0 <= a["semantic_agreeing"] <= 3 for a in answers)
    # progress on stderr, a line per tenth of each stage (a full run takes tens of minutes): both sets' 8 + 6 questions
    assert "greedy answers: 14/14 questions" in stderr and "3 sampled answers each: 14/14 questions" in stderr


def test_calm_eval_of_open_ended_questions_offline_equals_through_the_gateway(gateway, tmp_path, offline_free_form):
    """Open-ended sets through `calm eval --gateway`: the greedy answers of the shipped free-form mode are the offline
    evaluation's (vLLM in process, the same head), their token confidence agrees to the dtype's tolerance, correctness
    is the same alias match, and the report has the same numbers."""
    import json

    from tests.hf_reference import option_tolerances

    atol, _ = option_tolerances(gateway)
    offline, _ = offline_free_form
    online = calm("eval", "-d", "triviaqa", "--limit", "8", "--samples", "0", "--gateway", gateway, "--concurrency",
                  "4", "--out", tmp_path / "online")
    assert online.returncode == 0, online.stderr
    runs = [{r["id"]: r for r in map(json.loads, (folder / "answers_triviaqa_sample.jsonl").read_text().splitlines())}
            for folder in (offline, tmp_path / "online")]
    assert runs[0].keys() == runs[1].keys() and len(runs[0]) == 8
    for qid, a in runs[0].items():
        b = runs[1][qid]
        assert (b["text"], b["correct"], b["n_tokens"]) == (a["text"], a["correct"], a["n_tokens"]), qid
        assert b["token_confidence"] == pytest.approx(a["token_confidence"], abs=atol)
        assert b["sequence_probability"] == pytest.approx(a["sequence_probability"], abs=atol)
    reports = [json.loads((folder / "report.json").read_text())["results"]["triviaqa:sample"]
               for folder in (offline, tmp_path / "online")]
    assert reports[1]["accuracy"] == reports[0]["accuracy"]
    assert reports[1]["mean_confidence"] == pytest.approx(reports[0]["mean_confidence"], abs=atol)


def test_what_reaches_an_openai_client_behind_litellm(gateway, tmp_path):
    """LiteLLM's proxy (tests/litellm_proxy.py; `hosted_vllm` provider) in front of the shipped gateway, the `openai`
    client behind it. LiteLLM rebuilds the body, so the `calibration` field does not arrive; the X-Calm-* headers do,
    as `llm_provider-x-calm-*`, with the gateway's own numbers. With `forward_client_headers_to_llm_api`, a client's
    X-Calm-Domain header reaches the gateway (LiteLLM keeps `metadata` for itself)."""
    from tests.litellm_proxy import MASTER_KEY, litellm_proxy

    question = {"messages": [{"role": "user", "content": "Which gas do plants absorb?"}],
                "extra_body": {"options": ["oxygen", "carbon dioxide", "helium"]}, "temperature": 0.0}
    direct = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120)
    expected = direct.chat.completions.with_raw_response.create(model=MODEL, **question)
    expected_answer = expected.parse().choices[0]
    assert float(expected.headers["x-calm-confidence"]) == calibration(expected_answer)["confidence"]
    settings = {"general_settings": {"forward_client_headers_to_llm_api": True}}
    with litellm_proxy(MODEL, f"{gateway}/v1", tmp_path, settings) as proxy:
        behind = openai.OpenAI(base_url=f"{proxy}/v1", api_key=MASTER_KEY, max_retries=0, timeout=120)
        plain = behind.chat.completions.with_raw_response.create(model=MODEL, **question)
        routed = behind.chat.completions.with_raw_response.create(model=MODEL, **question,
                                                                  extra_headers={"X-Calm-Domain": "science"})
    answer = plain.parse().choices[0]
    assert answer.message.content == expected_answer.message.content  # the options reached the gateway
    assert (answer.model_extra or {}).get("calibration") is None  # the body field is LiteLLM's casualty
    headers = {k.lower(): v for k, v in plain.headers.items()}
    assert float(headers["llm_provider-x-calm-confidence"]) == calibration(expected_answer)["confidence"]
    assert headers["llm_provider-x-calm-abstained"] == "false"
    assert headers["llm_provider-x-calm-artifact-version"] == expected.headers["x-calm-artifact-version"]
    assert headers["llm_provider-x-calm-domain"] == "other"
    assert routed.headers["llm_provider-x-calm-domain"] == "science"


def test_calm_eval_through_the_gateway_in_a_domain_scores_the_version_serving_that_domain(started, tmp_path,
                                                                                        shipped_artifact):
    """`calm eval --gateway --domain D` asks every question in D, so the version serving D answers: the same option
    probabilities as `calm eval --artifact` of that version. Without --domain each question goes in its own domain
    (ARC: science), which the shipped version serves. The version for D is the shipped one with its option scores
    at twice the temperature (its engines are the shipped ones: same weights and head)."""
    import json

    from calm_core.artifact import derive_version
    from tests.hf_reference import option_tolerances

    gateway, admin = started["base"], {"Authorization": "Bearer dev-admin-key"}
    atol, _ = option_tolerances(gateway)
    flatter = derive_version(shipped_artifact.path, tmp_path / "flatter", "recalibrated",
                             option_temperature=shipped_artifact.manifest.option_temperature * 2)
    added = calm("artifacts", "add", tmp_path / "flatter", "--domain", "commonsense", "--promote",
                 env={"CALM_DB_PATH": str(started["db"])})
    assert added.returncode == 0, added.stderr
    try:
        wait_until("the gateway to serve the new version for commonsense", lambda: http.get(
            f"{gateway}/health", headers=admin).json()["versions"]["routes"].get("commonsense") ==
            flatter.artifact_version, 300, 0.5)
        runs = {"offline": ["--artifact", tmp_path / "flatter"],
                "in_domain": ["--gateway", gateway, "--domain", "commonsense"], "own_domain": ["--gateway", gateway]}
        for name, args in runs.items():
            out = calm("eval", "-d", "arc_easy:dev", "--limit", "6", *args, "--out", tmp_path / name)
            assert out.returncode == 0, out.stderr
        probs = {name: np.load(tmp_path / name / "probs_arc_easy_dev.npz")["probs"] for name in runs}
        np.testing.assert_allclose(probs["in_domain"], probs["offline"], atol=atol)
        assert np.abs(probs["own_domain"] - probs["offline"]).max() > 20 * atol  # the shipped version answered those
        report = json.loads((tmp_path / "in_domain" / "report.json").read_text())
        assert report["artifact"] == flatter.artifact_version
        assert json.loads((tmp_path / "own_domain" / "report.json").read_text())["artifact"] == \
            shipped_artifact.manifest.artifact_version
    finally:  # the domain back on the shipped version for the file's other tests
        r = http.post(f"{gateway}/admin/domains/commonsense/rollback", headers=admin, timeout=60)
        assert r.status_code == 200, r.text
