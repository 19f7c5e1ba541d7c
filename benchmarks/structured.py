"""Structured outputs over a WAN: tokens per lap and tokens/s of JSON-schema extraction with grammar
drafts on and off, and of free text on the same prompts, in a local SmolLM2 swarm behind delay proxies.

    python -m benchmarks.structured                    # 20 records, 25 ms per hop
    python -m benchmarks.structured --prompts 4 --max-new-tokens 48   # a quick look

Each prompt asks the model to extract a record (4-6 fields) from a sentence, as a chat; the schema
mode constrains the reply to the record's JSON schema (generate(guided_json=...)). Modes run one
after another on each prompt in the same swarm, so they share the machine's noise:

* free text: no constraint, the default drafter (suffix, looped runs): what the swarm does today
* schema, no speculation: the constraint alone, one token per lap
* schema, suffix: the constraint with the default drafter, grammar drafts off
* schema, suffix + grammar: the default: the ids the constraint forces drafted ahead (client/drafting/grammar.py)
* schema, draft model: a local draft model on the client (generate(draft_model=M), client/draft_model.py):
  SmolLM2-135M's first ``--draft-blocks`` of its 30 blocks (layer-skip, as in benchmarks/dssd.py: the
  only smaller model with its tokenizer is itself), proposing under the same constraint, the ids the
  grammar forces first; ``num_draft_tokens`` 8 (its default)

Every schema reply is checked to parse and validate against its schema (jsonschema) when it ended
(EOS) within the token budget, and every schema mode's reply must equal the no-speculation one (the
drafters never change greedy output: counted, and a difference printed). Per mode: laps, drafts
accepted per lap, wall time. Results go to stdout as a Markdown table and to
benchmarks/results/structured.json (rewritten after each prompt, so a run cut short keeps what it
measured).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import jsonschema
import torch
from transformers import AutoModelForCausalLM

from benchmarks.wan import _commit
from protocol.models import ensure_smollm2_checkpoint
from swarm.local import LocalSwarm


def _schema(fields: dict) -> dict:
    return {"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False}


NAME, INT = {"type": "string", "maxLength": 40}, {"type": "integer", "minimum": 0, "maximum": 100000}
PERSON = _schema({"name": NAME, "age": INT, "city": NAME, "occupation": NAME})
ORDER = _schema({"order_id": NAME, "customer": NAME, "item": NAME, "quantity": INT, "express": {"type": "boolean"}})
EVENT = _schema(
    {"title": NAME, "city": NAME, "month": {"enum": ["January", "February", "March", "April", "May", "June",
                                                     "July", "August", "September", "October", "November",
                                                     "December"]},
     "attendees": INT, "online": {"type": "boolean"}, "organiser": NAME}
)  # fmt: skip
RECORDS = [
    (PERSON, "Maria Lopez, 34, moved to Valencia last year and works there as a nurse."),
    (PERSON, "The new intern, Tom Becker, is 22 years old; he studies physics in Leipzig."),
    (PERSON, "Aiko Tanaka (41) runs a bakery in Osaka."),
    (PERSON, "Retired pilot James O'Neill, aged 67, lives in Dublin."),
    (PERSON, "Priya Raman is a 29-year-old software engineer based in Pune."),
    (PERSON, "In Lagos, 52-year-old Chidi Okafor teaches mathematics."),
    (PERSON, "Lena Novak, a journalist from Zagreb, turned 38 in May."),
    (ORDER, "Order A-1043: Jane Smith bought 3 blue kettles, express delivery requested."),
    (ORDER, "Customer Ahmed Ali placed order 77812 for 12 notebooks, standard shipping."),
    (ORDER, "Order #5590 from Ingrid Berg: one standing desk, please ship express."),
    (ORDER, "Paul Martin ordered 40 tennis balls (order TB-22), no rush."),
    (ORDER, "Order Z9 by Sofia Rossi: 2 espresso machines, express."),
    (ORDER, "Kenji Sato's order 3141 is for 5 mechanical keyboards with regular delivery."),
    (EVENT, "PyCon Lisbon takes place in October with about 900 attendees, organised by the Python Society."),
    (EVENT, "The online Rust meetup in March drew 120 people; host: Ferris Club, based in Berlin."),
    (EVENT, "Jazz by the River, Prague, June: 3000 visitors expected, run by the city council."),
    (EVENT, "A 40-person chess workshop, held online from Madrid in January by Club Ajedrez."),
    (EVENT, "Oslo Tech Summit in September: 1500 attendees, organised by Nordic Ventures."),
    (EVENT, "The Nairobi book fair in August welcomed 2500 readers; organiser: Kenya Publishers."),
    (EVENT, "Toronto's winter hackathon in February, 250 coders, run by MakerSpace TO."),
]
MODES = {
    "free text": dict(constrained=False),
    "schema, no speculation": dict(constrained=True, speculation=None),
    "schema, suffix": dict(constrained=True, grammar_drafts=False),
    "schema, suffix + grammar": dict(constrained=True),
    "schema, draft model": dict(constrained=True, draft_model=True),
}
DRAFT_BLOCKS = 24  # of SmolLM2-135M's 30 (benchmarks/dssd.py's layer-skip drafter)


def draft_model(blocks: int):
    """SmolLM2-135M cut to its first ``blocks`` blocks: a local drafter with the target's tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(ensure_smollm2_checkpoint(), dtype="float32").eval()
    model.model.layers = model.model.layers[:blocks]
    model.config.num_hidden_layers = blocks
    return model


def messages(schema: dict, text: str) -> list[dict]:
    keys = ", ".join(schema["properties"])
    return [{"role": "user", "content": f"Extract {keys} from this text as JSON.\nText: {text}"}]


def run(args, save) -> list[dict]:
    from swarm import AutoDistributedModelForCausalLM

    rows: list[dict] = []
    torch.set_num_threads(1)  # the draft model runs in this process, beside the servers'
    drafter = draft_model(args.draft_blocks)
    server_args = ["--torch-threads", "1", "--log-level", "WARNING"]
    with LocalSwarm("smollm2-135m", args.servers, hop_delay_ms=args.delay, server_args=server_args) as swarm:
        model = AutoDistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=swarm.initial_peers)
        tokenizer = model.tokenizer
        model.generate(tokenizer("Hello", return_tensors="pt")["input_ids"], max_new_tokens=4, speculation=None)
        for index, (schema, text) in enumerate(RECORDS[: args.prompts]):
            ids = tokenizer.apply_chat_template(messages(schema, text), add_generation_prompt=True, return_dict=True)
            ids = ids["input_ids"]
            plain = None  # the schema reply without speculation: every schema mode must equal it
            for mode, spec in MODES.items():
                kwargs = {k: v for k, v in spec.items() if k not in ("constrained", "draft_model")}
                if spec["constrained"]:
                    kwargs["guided_json"] = schema
                if spec.get("draft_model"):
                    kwargs["draft_model"] = drafter
                out = model.generate([ids], max_new_tokens=args.max_new_tokens, **kwargs)[0, len(ids) :].tolist()
                stats = model.last_generation_stats
                if spec["constrained"]:
                    plain = out if plain is None else plain
                    if out != plain:
                        print(f"  !! {mode} changed the reply to prompt {index}", flush=True)
                ended = bool(out) and out[-1] == model.config.eos_token_id
                valid = None
                if spec["constrained"] and ended:
                    jsonschema.validate(json.loads(tokenizer.decode(out[:-1])), schema)
                    valid = True
                rows.append(
                    dict(
                        prompt=index,
                        mode=mode,
                        tokens=len(out),
                        laps=stats.laps,
                        drafted=stats.drafted,
                        accepted=stats.accepted,
                        seconds=stats.wall_time,
                        ended=ended,
                        valid=valid,
                        same=out == plain if spec["constrained"] else None,
                    )
                )
                print(
                    f"  {index} {mode}: {len(out)} tokens in {stats.laps} laps, {stats.accepted} drafts accepted, "
                    f"{stats.wall_time:.1f} s",
                    flush=True,
                )
            save(rows)
        model.shutdown()
    return rows


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        tokens, laps, accepted, seconds = (sum(r[k] for r in mine) for k in ("tokens", "laps", "accepted", "seconds"))
        out.append(
            dict(
                mode=mode,
                laps=laps,
                accepted_per_lap=accepted / laps,
                seconds=seconds,
                tokens_per_lap=tokens / laps,
                tokens_per_s=tokens / seconds,
                median_tokens=statistics.median(r["tokens"] for r in mine),
                ended=sum(r["ended"] for r in mine),
                same=sum(bool(r["same"]) for r in mine),
                runs=len(mine),
            )
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delay", type=float, default=25.0, help="ms per hop")
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--prompts", type=int, default=len(RECORDS))
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--draft-blocks", type=int, default=DRAFT_BLOCKS, help="the draft model's blocks (of 30)")
    p.add_argument("--out", default="benchmarks/results/structured.json")
    args = p.parse_args()
    commit = _commit()  # the checkout the run starts from (edits made while it runs are not measured)

    def save(rows: list[dict]) -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        table = summary(rows)
        Path(args.out).write_text(json.dumps(dict(commit=commit, args=vars(args), rows=rows, summary=table), indent=1))

    rows = run(args, save)
    table = summary(rows)
    free = table[0]["tokens_per_lap"]
    print(f"\n{args.prompts} prompts, {args.delay:.0f} ms per hop, {args.servers} servers, commit {commit}")
    print(
        "| mode | tokens/lap | vs free text | drafts accepted/lap | laps | wall s | tokens/s | ended (EOS) |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for r in table:
        print(
            f"| {r['mode']} | {r['tokens_per_lap']:.2f} | {r['tokens_per_lap'] / free:.2f}x | "
            f"{r['accepted_per_lap']:.2f} | {r['laps']} | {r['seconds']:.1f} | {r['tokens_per_s']:.1f} | "
            f"{r['ended']}/{r['runs']} |"
        )
    save(rows)


if __name__ == "__main__":
    main()
