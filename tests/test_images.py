"""Images (issue 25): image blocks of prompts, `/messages` conversations and tool outputs reach a vision-language
model as image parts on every path (TRL's `environment_factory` loop, `spec.rollout_func`, eval's OpenAI and local
policies), checked and decoded once behind Pillow's guards; hostile images are placeholders, never a crash; a
text-only environment gives exactly today's strings; records keep each image once beside the log and the report
shows thumbnails (checked in headless Chromium); a real `GRPOTrainer` step on a tiny Qwen2-VL model receives the
environment's pixels in its forward passes on both rollout paths; a tokenizer-only trainer is told what to do."""

from __future__ import annotations

import base64
import hashlib
import inspect
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from ors_trl import (
    ConfigurationError,
    ImageBlock,
    ImageError,
    LocalPolicy,
    OpenAIPolicy,
    OpenRewardSpec,
    write_report,
)
from ors_trl.cli import main
from ors_trl.cli.inspect import collect, render_text
from ors_trl.core.conversation import content
from ors_trl.core.records import RecordWriter, read_records
from ors_trl.protocol import images as _images
from ors_trl.protocol.loop import get_loop
from ors_trl.protocol.types import parse_blocks
from ors_trl.testing import ReferenceServer
from ors_trl.trl import backend as _trl
from tests.conftest import check_no_leaks
from tests.fixtures.environments import (
    BAD_IMAGES,
    CARD_SAMPLE,
    CARD_SYSTEM,
    CARD_WORDS,
    BadImageEnvironment,
    CardEnvironment,
    CardJudgeEnvironment,
    EchoEnvironment,
    ImageEnvironment,
    QuizEnvironment,
    SparseEnvironment,
    card_png,
)
from tests.fixtures.generation import (
    cpu_grpo_trainer,
    replace_generation,
    stub_trainer,
    tool_call_text,
    trl_generation,
)
from tests.fixtures.vision import load_vision
from tests.test_eval import FakeOpenAI
from tests.test_report import chromium, run_chromium  # noqa: F401 - the session fixture

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def image_server() -> Any:
    """A reference server of its own: the image environments, and the text-only ones compared with today's strings."""
    with ReferenceServer([CardEnvironment, BadImageEnvironment, ImageEnvironment, EchoEnvironment, QuizEnvironment,
                          SparseEnvironment, CardJudgeEnvironment]) as server:
        yield server


@pytest.fixture(autouse=True)
def _no_leaked_sessions(image_server: ReferenceServer) -> Any:
    yield
    check_no_leaks(image_server)

CARDS, BAD, SQUARES = "cardenvironment", "badimageenvironment", "imageenvironment"


def pixels(png: bytes) -> Image.Image:
    return Image.open(io.BytesIO(png)).convert("RGB")


def same_image(part: Any, png: bytes) -> bool:
    return part["type"] == "image" and list(part["image"].getdata()) == list(pixels(png).getdata())


def wire(raw: bytes, mime: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "data": base64.b64encode(raw).decode("ascii"), "mimeType": mime}


# -- the decode boundary -------------------------------------------------------------------------------------------


def test_an_image_is_checked_once_and_decoded_once() -> None:
    png = card_png("cat")
    [block] = parse_blocks([wire(png)], where="test")
    info = block.info()
    assert (info.sha256, info.bytes, info.width, info.height, info.error) == (
        hashlib.sha256(png).hexdigest(), len(png), 56, 28, None)
    image = block.image()
    assert image.mode == "RGB" and image.size == (56, 28) and block.image() is image and block.info() is info
    assert list(image.getdata()) == list(pixels(png).getdata())
    # transparency is laid over white, a palette becomes RGB: what a processor takes
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    out = io.BytesIO()
    rgba.save(out, format="PNG")
    [clear] = parse_blocks([wire(out.getvalue())], where="test")
    assert clear.image().getpixel((0, 0)) == (255, 255, 255)


WHY = {"base64": "not valid base64", "mime": "not an image type", "bomb": "decompression bomb",
       "large": "characters of base64", "corrupt": "not a valid PNG image", "disguised": "not a JPEG file",
       "svg": "not an image type", "many": f"more than {_images.MAX_IMAGES} images"}


@pytest.mark.parametrize("kind", BAD_IMAGES)
def test_hostile_images_are_placeholders_in_prompts_and_tool_outputs(image_server, kind: str) -> None:
    """Each hostile image (in the prompt beside a good card, and from a tool) is a visible text placeholder saying
    why; the good card still reaches the model; nothing raises; a bomb's pixels are never decoded."""
    spec = OpenRewardSpec(image_server.url, env_name=BAD)
    env = spec.environment_factory()
    try:
        prompt = env.reset(task_index=BAD_IMAGES.index(kind))
        output = env.show(kind=kind)
        for shown in (prompt, output):
            text = "".join(p["text"] for p in shown if p["type"] == "text") if isinstance(shown, list) else shown
            assert "[image not shown (" in text and WHY[kind] in text, text[:300]
        if kind == "many":  # the first MAX_IMAGES are shown, the ones past the bound are not
            assert sum(p["type"] == "image" for p in output) == _images.MAX_IMAGES
            assert sum(p["type"] == "image" for p in prompt) == _images.MAX_IMAGES
        else:
            assert same_image(prompt[-1], card_png("fine"))
            assert isinstance(output, str) and output.endswith(f"\nthat was {kind}")
            record = env.episode.record()
            assert any(WHY[kind] in (i.get("error") or "") for i in record["images"].values())
        if kind == "bomb":
            [bomb] = [b for b in env.episode.prompt.messages[0].blocks if isinstance(b, ImageBlock)
                      and b.info().error]
            assert bomb._image is None  # Pillow refused it at its header: no pixel was decoded
            with pytest.raises(ImageError, match="decompression bomb"):
                bomb.image()
        assert env.good() != []  # the session goes on
    finally:
        env.close()
        spec.close()


def test_without_pillow_every_image_is_a_placeholder(monkeypatch) -> None:
    monkeypatch.setattr(_images, "_pillow", lambda: None)
    blocks = parse_blocks([{"type": "text", "text": "see"}, wire(card_png("cat"))], where="test")
    assert content(blocks) == "see\n[image not shown (image/png): Pillow is not installed (pip install 'ors-trl[vision]')]"
    assert content(blocks, images=False) == "see\n[image: image/png]"


# -- text-only environments: exactly today's strings ----------------------------------------------------------------

#: What ors-trl gave before images were passed (its code at the commit before this change, against the same servers).
TODAY = {
    "echoenvironment": {
        "reset": 'Call the `echo` tool with exactly this text: "world". Do not add anything else.',
        "calls": [("echo", {"text": "hello"})], "outputs": ["hello"],
        "chat": [{"role": "system", "content": "S"},
                 {"role": "user", "content": 'Hi Call the `echo` tool with exactly this text: "world". Do not add '
                                             'anything else.'}]},
    "quizenvironment": {
        "reset": "You are a geography quiz. You may look a country up; then answer with the capital city only.\n\n"
                 "What is the capital of Japan?",
        "calls": [("lookup", {"country": "France"})], "outputs": ["The capital of France is Paris."],
        "chat": [{"role": "system", "content": "S\n\nYou are a geography quiz. You may look a country up; then "
                                               "answer with the capital city only."},
                 {"role": "user", "content": "Hi What is the capital of Japan?"}]},
    "sparseenvironment": {
        "reset": "What is 10 + 6? You may use `calculator`; then call `submit` with the answer.",
        "calls": [("calculator", {"expression": "2 + 3"})], "outputs": ["5"],
        "chat": [{"role": "system", "content": "S"},
                 {"role": "user", "content": "Hi What is 10 + 6? You may use `calculator`; then call `submit` with "
                                             "the answer."}]},
    # an image environment with images="placeholder": today's marker, on purpose
    SQUARES: {
        "reset": "What colour is this square? Call `snapshot` with the colour.\n[image: image/png]",
        "calls": [("snapshot", {"color": "red", "size": 4})], "outputs": ["[image: image/png]\nA 4x4 red square."],
        "chat": [{"role": "system", "content": "S"},
                 {"role": "user", "content": "Hi What colour is this square? Call `snapshot` with the colour.\n"
                                             "[image: image/png]"}]},
}


@pytest.mark.parametrize("name", sorted(TODAY))
def test_text_only_environments_give_todays_strings(image_server, name: str) -> None:
    today = TODAY[name]
    spec = OpenRewardSpec(image_server.url, env_name=name, **({"images": "placeholder"} if name == SQUARES else {}))
    env = spec.environment_factory()
    try:
        assert env.reset(task_index=1) == today["reset"]
        assert [getattr(env, tool)(**args) for tool, args in today["calls"]] == today["outputs"]
        assert env.last_output == today["outputs"][-1]
        prompt = env.episode.prompt
        assert prompt.chat([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi "}],
                           images=name != SQUARES) == today["chat"]
        assert prompt.flat == today["reset"]
        record = env.episode.record()
        if name != SQUARES:  # a text-only episode's record is what it always was
            assert "images" not in record and "prompt_images" not in record
            assert "images" not in record["turns"][0]["tool_calls"][0]
    finally:
        env.close()
        spec.close()


# -- every path: the adapter (by hand), records and the report -------------------------------------------------------


@pytest.fixture(scope="module")
def card_log(image_server, tmp_path_factory) -> Path:
    """An episode log of two card episodes (a `/messages` prompt with the sample card, `look`'s card, `say`) and one
    episode of the hostile-image environment, played through the adapter by hand."""
    log = tmp_path_factory.mktemp("card-log") / "episodes.jsonl"
    spec = OpenRewardSpec(image_server.url, env_name=CARDS, episode_log=str(log))
    for index in (0, 1):
        env = spec.environment_factory()
        env.reset(task_index=index)
        env.look()
        env.say(text=CARD_WORDS[index])
        env.close()
    spec.close()
    bad = OpenRewardSpec(image_server.url, env_name=BAD, episode_log=str(log))
    env = bad.environment_factory()
    env.reset(task_index=BAD_IMAGES.index("bomb"))
    env.close()
    bad.close()
    return log


def test_images_reach_the_adapter_from_conversations_prompts_and_tools(image_server) -> None:
    spec = OpenRewardSpec(image_server.url, env_name=CARDS)
    env = spec.environment_factory()
    try:
        prompt = env.reset(task_index=2)  # a /messages conversation, flattened as TRL's reset() takes it
        assert [p["type"] for p in prompt] == ["text", "image", "text"]
        assert prompt[0]["text"] == f"{CARD_SYSTEM}\n\nA sample card:\n" and prompt[2]["text"] == "\nNow read yours."
        assert same_image(prompt[1], card_png(CARD_SAMPLE))
        looked = env.look()
        assert looked[0] == {"type": "text", "text": "Your card:\n"} and same_image(looked[1], card_png("map"))
        assert env.last_output == "Your card:\n[image: image/png]"
        assert env.say(text="map") == "right" and env.reward == 1.0
        chat = env.episode.prompt.chat([{"role": "user", "content": ""}])  # what the engine and eval render
        assert chat[0] == {"role": "system", "content": CARD_SYSTEM}
        assert chat[1]["content"][0] == {"type": "text", "text": ""} and same_image(chat[1]["content"][2],
                                                                                   card_png(CARD_SAMPLE))
    finally:
        env.close()
        spec.close()
    squares = OpenRewardSpec(image_server.url, env_name=SQUARES)  # /prompt blocks
    env = squares.environment_factory()
    try:
        shown = env.reset(task_index=0)
        assert shown[0]["text"].startswith("What colour") and shown[1]["image"].size == (4, 4)
        assert env.snapshot(color="red", size=3)[0]["image"].getpixel((1, 1)) == (220, 30, 30)
    finally:
        env.close()
        squares.close()


def test_records_keep_each_image_once_beside_the_log(card_log) -> None:
    records = list(read_records(card_log))
    assert len(records) == 3
    folder = card_log.with_name("episodes.jsonl.images")
    for record, word in zip(records[:2], CARD_WORDS, strict=False):
        sample, card = (hashlib.sha256(card_png(w)).hexdigest() for w in (CARD_SAMPLE, word))
        assert record["prompt_images"] == [sample]
        look = record["turns"][0]["tool_calls"][0]
        assert look["images"] == [card] and look["output"] == "Your card:\n[image: image/png]"
        assert set(record["images"]) == {sample, card}
        for sha, entry in record["images"].items():
            assert entry["mime_type"] == "image/png" and (entry["width"], entry["height"]) == (56, 28)
            path = card_log.parent / entry["file"]
            assert path.parent == folder and hashlib.sha256(path.read_bytes()).hexdigest() == sha
            assert entry["bytes"] == path.stat().st_size
    assert len(list(folder.iterdir())) == 4  # the sample card of both episodes once, and their two cards
    bomb = [e for e in records[2]["images"].values() if "error" in e]
    assert bomb and "file" not in bomb[0] and "decompression bomb" in bomb[0]["error"]


def test_the_image_folder_is_bounded(tmp_path) -> None:
    [block] = parse_blocks([wire(card_png("cat"))], where="test")
    sha = block.info().sha256
    writer = RecordWriter(tmp_path / "log.jsonl", max_image_bytes=10)
    writer.write({"reward": 1.0, "images": {sha: {"mime_type": "image/png", "bytes": block.info().bytes}}},
                 images={sha: block})
    [record] = read_records(tmp_path / "log.jsonl")
    assert "file" not in record["images"][sha] and writer.images_dropped == 1 and writer.written == 1
    assert not (tmp_path / "log.jsonl.images").exists()


def test_report_shows_thumbnails_in_chromium(card_log, chromium, tmp_path) -> None:  # noqa: F811
    old = tmp_path / "old.jsonl"  # a record of an earlier version (no images) reads as it always did
    old.write_text(json.dumps({"version": 2, "run": "r", "source": "trl", "environment": "echo", "split": "train",
                               "task_index": 0, "prompt": "hi", "turns": [], "reward": 1.0}) + "\n")
    planted = tmp_path / "planted.jsonl"  # a record naming a file whose bytes are not that image: no thumbnail
    rec = next(read_records(card_log))
    sha = hashlib.sha256(card_png("yyy")).hexdigest()
    (tmp_path / "planted.jsonl.images").mkdir()
    (tmp_path / "planted.jsonl.images" / f"{sha}.png").write_bytes(card_png("zzz"))
    planted.write_text(json.dumps({**rec, "run": "planted", "prompt_images": [sha], "images": {sha: {
        "mime_type": "image/png", "bytes": 1, "width": 56, "height": 28, "file": f"planted.jsonl.images/{sha}.png"}},
        "turns": []}) + "\n")
    out = tmp_path / "report.html"
    summary = write_report([card_log, old, planted], out)
    assert summary.episodes == 5 and summary.embedded == 5
    result = run_chromium(chromium, tmp_path / "profile", "--dump-dom", out.as_uri() + "#expand")
    dom = result.stdout
    assert 'data-report-ready="1"' in dom and "data-js-error" not in re.search(r"<body[^>]*>", dom).group(0), \
        result.stderr[-2000:]
    thumbs = re.findall(r'<img src="data:image/png;base64,([^"]+)"', dom)
    assert len(thumbs) == 5  # two card episodes: the sample card and the card each; the bad one's good card
    assert all(Image.open(io.BytesIO(base64.b64decode(t))).size == (56, 28) for t in thumbs)
    assert dom.count('<div class="nothumb">no image file beside the log</div>') == 1  # the planted one
    assert '<div class="nothumb">not shown to the model: Pillow refused it as a decompression bomb' in dom


# -- eval: an OpenAI-compatible endpoint, a local vision-language model ---------------------------------------------


class CardOpenAI(FakeOpenAI):
    """An OpenAI-compatible endpoint that looks, then says "cat", then is done; records every request."""

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        turns = sum(m["role"] == "assistant" for m in body["messages"])
        calls = [("look", {}), ("say", {"text": "cat"})]
        message: dict[str, Any] = {"role": "assistant", "content": "Done."}
        if turns < len(calls):
            name, args = calls[turns]
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{turns}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}
        return web.json_response({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})


def decoded_url(url: str) -> Image.Image:
    assert url.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


@pytest.mark.parametrize("tool_images", ["tool", "user"])
def test_openai_policy_sends_image_url_parts(image_server, tool_images: str) -> None:
    endpoint = CardOpenAI().start()
    spec = OpenRewardSpec(image_server.url, env_name=CARDS)
    try:
        report = spec.evaluate(OpenAIPolicy(endpoint.url, "vlm", tool_images=tool_images), indices=[0],
                               progress=False)
    finally:
        endpoint.stop()
        spec.close()
    assert report.mean_reward == 1.0
    last = endpoint.requests[-1]["messages"]
    user = last[1]["content"]
    assert [p["type"] for p in user] == ["text", "image_url", "text"]
    assert list(decoded_url(user[1]["image_url"]["url"]).getdata()) == list(pixels(card_png(CARD_SAMPLE)).getdata())
    tool = next(m for m in last if m["role"] == "tool" and m["tool_call_id"] == "c0")
    if tool_images == "tool":
        url = tool["content"][1]["image_url"]["url"]
    else:  # the tool message keeps its text; its image follows in a user message
        assert tool["content"] == "Your card:\n"
        after = last[last.index(tool) + 1]
        assert after["role"] == "user" and [p["type"] for p in after["content"]] == ["image_url"]
        url = after["content"][0]["image_url"]["url"]
    assert list(decoded_url(url).getdata()) == list(pixels(card_png("cat")).getdata())


def test_group_scored_eval_writes_the_images_beside_its_output(image_server, tmp_path) -> None:
    """With `score_groups`, records are written once the group is scored: their images are written beside too."""
    endpoint = CardOpenAI().start()
    spec = OpenRewardSpec(image_server.url, env_name="cardjudgeenvironment", score_groups=True)
    out = tmp_path / "eval.jsonl"
    try:
        report = spec.evaluate(OpenAIPolicy(endpoint.url, "vlm"), indices=[0], repeats=2, score_groups=True,
                               output=out, progress=False)
    finally:
        endpoint.stop()
        spec.close()
    assert report.mean_reward == 1.0 and report.mean_group_reward == 0.5
    records = list(read_records(out))
    hashes = {hashlib.sha256(card_png(w)).hexdigest() for w in (CARD_SAMPLE, "cat")}
    assert len(records) == 2 and all(set(r["images"]) == hashes for r in records)
    for record in records:
        for sha, entry in record["images"].items():
            path = tmp_path / entry["file"]
            assert path.parent == tmp_path / "eval.jsonl.images" and hashlib.sha256(path.read_bytes()).hexdigest() == sha
    assert len(list((tmp_path / "eval.jsonl.images").iterdir())) == 2


def test_placeholder_mode_sends_the_marker_on_every_path_of_eval(image_server) -> None:
    endpoint = CardOpenAI().start()
    spec = OpenRewardSpec(image_server.url, env_name=CARDS, images="placeholder")
    try:
        report = spec.evaluate(OpenAIPolicy(endpoint.url, "text-model"), indices=[0], progress=False)
    finally:
        endpoint.stop()
        spec.close()
    assert report.mean_reward == 1.0
    last = endpoint.requests[-1]["messages"]
    assert last[1]["content"] == "A sample card:\n[image: image/png]\nNow read yours."
    assert next(m for m in last if m["role"] == "tool")["content"] == "Your card:\n[image: image/png]"


class ScriptedVision:
    """A real tiny vision-language model's `generate` (its forward passes run, on the pixels given), with a scripted
    reply: look, then say "cat", then done."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.config, self.device = model, model.config, model.device
        self.replies = [tokenizer.encode(text + "<|im_end|>", add_special_tokens=False) for text in
                        (tool_call_text("look", {}), tool_call_text("say", {"text": "cat"}), "Done.")]
        self.response = tokenizer.convert_tokens_to_ids("<tool_response>")

    def generate(self, input_ids: Any, **kwargs: Any) -> Any:
        self.model.generate(input_ids=input_ids, **{**kwargs, "max_new_tokens": 1})
        rows = [ids + self.replies[min(ids.count(self.response), 2)] for ids in input_ids.tolist()]
        width = max(map(len, rows))
        return torch.tensor([r + [kwargs["pad_token_id"]] * (width - len(r)) for r in rows])


def vision_hook(model: Any) -> list[tuple[bool, Any]]:
    """Every call of the model's vision tower: (gradients on, the pixel values it received)."""
    seen: list[tuple[bool, Any]] = []
    model.model.visual.register_forward_hook(lambda module, args, out: seen.append((torch.is_grad_enabled(),
                                                                                    args[0].detach().clone())))
    return seen


def expected_pixels(processor: Any, words: list[str]) -> Any:
    return processor.image_processor(images=[pixels(card_png(w)) for w in words], return_tensors="pt")["pixel_values"]


def test_local_policy_runs_a_vision_model_through_its_processor(image_server, tiny_vlm_dir) -> None:
    model, processor = load_vision(tiny_vlm_dir)
    seen = vision_hook(model)
    spec = OpenRewardSpec(image_server.url, env_name=CARDS)
    try:
        report = spec.evaluate((ScriptedVision(model, processor.tokenizer), processor), indices=[0], progress=False)
    finally:
        spec.close()
    assert report.mean_reward == 1.0 and report.turns_per_episode == 3.0
    # turn 1 sees the sample card; turns 2 and 3 the sample card and the card `look` returned
    assert len(seen) == 3 and torch.equal(seen[0][1], expected_pixels(processor, [CARD_SAMPLE]))
    assert all(torch.equal(s[1], expected_pixels(processor, [CARD_SAMPLE, "cat"])) for s in seen[1:])
    policy = LocalPolicy(model, processor.tokenizer)  # a tokenizer cannot take the images: the episode says so
    spec = OpenRewardSpec(image_server.url, env_name=CARDS)
    try:
        report = spec.evaluate(policy, indices=[0], progress=False)
    finally:
        spec.close()
    assert report.num_errors == 1 and 'images="placeholder"' in report.episodes[0]["error"]["message"]


# -- a real GRPOTrainer step on a tiny Qwen2-VL model, both rollout paths ---------------------------------------------


def scripted_generation(trainer: Any) -> list[tuple[list[int], Any]]:
    """Replace the trainer's generation by its real one (its forward passes run on the images given), followed by
    scripted replies: look, say "cat", done. Returns what each call was given: image counts and field names."""
    tokenizer = trainer.processing_class.tokenizer
    replies = [tokenizer.encode(text + "<|im_end|>", add_special_tokens=False) for text in
               (tool_call_text("look", {}), tool_call_text("say", {"text": "cat"}), "Done.")]
    response = tokenizer.convert_tokens_to_ids("<tool_response>")
    real, calls = trl_generation(trainer), []

    def generate(prompt_ids: Any, images: Any, fields: Any, num_generations: int, **kwargs: Any) -> Any:
        calls.append(([len(i or []) for i in images or []], sorted(fields)))
        real(prompt_ids, images, fields, num_generations=num_generations, **kwargs)
        return [list(replies[min(list(ids).count(response), 2)]) for ids in prompt_ids], None

    replace_generation(trainer, generate)
    return calls


@pytest.mark.parametrize("path", ["environment_factory", "rollout_func"])
def test_a_grpo_step_on_a_tiny_vlm_receives_the_environments_pixels(image_server, tiny_vlm_dir, tmp_path,
                                                                     path: str) -> None:
    spec = OpenRewardSpec(image_server.url, env_name=CARDS, indices=[0])
    rollout = {path: spec.environment_factory if path == "environment_factory" else spec.rollout_func}
    try:
        trainer = cpu_grpo_trainer(tiny_vlm_dir, str(tmp_path), batch=2, generations=2, turns=3,
                                   completion_length=256, train_dataset=spec.train_dataset,
                                   reward_funcs=spec.reward_funcs, **rollout)
        calls = scripted_generation(trainer)
        seen = vision_hook(trainer.model)
        trainer.train()
    finally:
        spec.close()
    processor = trainer.processing_class
    # generation: the prompt's sample card, then with the card `look` returned, for both rollouts
    assert [c[0] for c in calls] == [[1, 1], [2, 2], [2, 2]]
    assert all("pixel_values" in c[1] and "image_grid_thw" in c[1] for c in calls)
    generated = [s[1] for s in seen if not s[0]]
    assert torch.equal(generated[0], expected_pixels(processor, [CARD_SAMPLE, CARD_SAMPLE]))
    # the loss: the forward pass with gradients received exactly the environment's pixels, in order
    [loss] = [s[1] for s in seen if s[0]]
    assert torch.equal(loss, expected_pixels(processor, [CARD_SAMPLE, "cat", CARD_SAMPLE, "cat"]))
    assert trainer.state.log_history[0]["reward"] == 1.0
    if path == "rollout_func":  # the hand-off counted the trainer as one with tools for that step only
        assert not trainer.tools


# -- a trainer that cannot take images ------------------------------------------------------------------------------


def text_trainer(model_dir: str, out: Path, spec: OpenRewardSpec, path: str) -> Any:
    rollout = {"environment_factory": spec.environment_factory} if path == "env" else {"rollout_func": spec.rollout_func}
    trainer = cpu_grpo_trainer(model_dir, str(out), batch=2, generations=2, turns=2, completion_length=128,
                               train_dataset=spec.train_dataset, reward_funcs=spec.reward_funcs, **rollout)
    tokenizer = trainer.processing_class
    look = tokenizer.encode(tool_call_text("look", {}) + "<|im_end|>", add_special_tokens=False)
    done = tokenizer.encode("Done.<|im_end|>", add_special_tokens=False)
    response = tokenizer.convert_tokens_to_ids("<tool_response>")
    replace_generation(trainer, lambda ids, *a, **k: ([list(look if response not in p else done) for p in ids], None))
    return trainer


@pytest.mark.parametrize(("path", "split"), [("env", "train"), ("env", "test"), ("engine", "train"),
                                             ("engine", "test")])
def test_a_tokenizer_trainer_meeting_images_is_told_to_use_placeholders(image_server, tiny_model_dir, tmp_path,
                                                                        path: str, split: str) -> None:
    """At its first rollout: the prompt's image (split train) or the image `look` returns (split test, a text-only
    prompt) is a ConfigurationError naming images="placeholder", not a crash inside TRL."""
    spec = OpenRewardSpec(image_server.url, env_name=CARDS, split=split, indices=[0])
    try:
        trainer = text_trainer(tiny_model_dir, tmp_path, spec, path)
        with pytest.raises(ConfigurationError, match=r'images="placeholder"') as raised:
            trainer.train()
        assert ("prompt" in str(raised.value)) == (split == "train") and "tokenizer" in str(raised.value)
    finally:
        spec.close()


def test_placeholder_mode_trains_a_text_model_on_purpose(image_server, tiny_model_dir, tmp_path) -> None:
    spec = OpenRewardSpec(image_server.url, env_name=CARDS, indices=[0], images="placeholder")
    try:
        trainer = text_trainer(tiny_model_dir, tmp_path, spec, "env")
        env = spec.environment_factory()
        assert env.reset(task_index=0).endswith("A sample card:\n[image: image/png]\nNow read yours.")
        assert env.look() == "Your card:\n[image: image/png]"
        env.close()
        trainer.train()
    finally:
        spec.close()
    assert trainer.state.log_history[0]["tools/call_frequency"] == 1.0


def test_a_trainer_whose_generate_is_its_own_is_refused() -> None:
    _trl.patch_grpo()

    class Own:
        def _generate(self, prompts: Any) -> Any:
            return prompts

    with pytest.raises(ConfigurationError, match="environment_factory"):
        _trl.Backend.of(Own()).hand_images([[object()]])
    _trl.Backend.of(Own()).hand_images([[], []])  # no images: nothing to hand


def test_continuous_batching_meeting_images_is_refused_before_generating() -> None:
    """TRL's continuous-batching generation takes no images: the engine says so instead of dropping them."""
    seen: list[Any] = []

    def generate(prompt_ids: Any, images: Any, fields: Any, num_generations: int) -> Any:
        seen.append(images)
        return [[7] for _ in prompt_ids], None

    card = pixels(card_png("cat"))
    trainer = stub_trainer(generate, use_transformers_continuous_batching=True, use_vllm=True, processing_class=None)
    backend = _trl.Backend.of(trainer)
    with pytest.raises(ConfigurationError, match="continuous-batching generation takes no images"):
        backend.generate([([1, 2], [card])], ([], []))
    assert seen == []
    assert backend.generate([([1, 2], [])], ([], [])) == [([7], None)]  # no image: generated as usual
    trainer.use_transformers_continuous_batching = False
    assert backend.generate([([1, 2], [card])], ([], [])) == [([7], None)] and seen[-1] == [[card]]


# -- inspect --------------------------------------------------------------------------------------------------------


def test_inspect_says_which_prompts_and_tools_carry_images(image_server, capsys) -> None:
    info = get_loop().run(collect(image_server.url, env_name=CARDS, calls=[("look", {}), ("say", {"text": "x"})]))
    assert [(i["role"], i["mime_type"], i["width"], i["height"]) for i in info["prompt_images"]] == [
        ("user", "image/png", 56, 28)]
    look, say = info["tool_outputs"]
    assert look["blocks"] == ["text", "image"] and len(look["images"]) == 1 and say["images"] == []
    text = render_text({**info, "binding": None})
    assert "Images in the probed prompt (1): image/png 56x28" in text
    assert "Tool output of look({}): blocks [text, image]; images (1): image/png 56x28" in text
    assert main(["inspect", image_server.url, "--env-name", BAD, "--call", 'show={"kind": "bomb"}']) == 0
    out = capsys.readouterr().out
    assert "not shown to a model: Pillow refused it as a decompression bomb" in out
    assert "Tool output of show" in out and "--call NAME" not in out
    assert main(["inspect", image_server.url, "--env-name", CARDS]) == 0
    assert "--call NAME[=JSON] calls one in the probe session" in capsys.readouterr().out
    assert main(["inspect", image_server.url, "--env-name", CARDS, "--call", "look=[1]"]) != 0


def test_every_bound_is_documented() -> None:
    doc = inspect.getdoc(_images) or ""
    for name in ("MAX_IMAGE_CHARS", "MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "MAX_IMAGES", "MAX_ANSWER_PIXELS",
                 "DecompressionBombError", "verify()"):
        assert name in doc, name
