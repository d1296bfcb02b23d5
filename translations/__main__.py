"""``python -m translations``: check, prepare and build the course's translations.

    python -m translations check [--lang ko]     every unit translated from today's English? (CI runs it)
    python -m translations refresh ID... [--lang ko] [--source FILTER]
                                                 after updating a stale unit's translation: record the
                                                 English it now translates (its hash and text)
    python -m translations export FILTER [--all]  print the units still to translate (all with --all) of
                                                 the sources whose path contains FILTER, as "=== ID"
                                                 blocks: the text to translate in place
    python -m translations import FILE [--source FILTER]
                                                 store the "=== ID" blocks of FILE as the translations of
                                                 those units (of the one source matching FILTER)
    python -m translations glossary [FILTER]     translated units that break the glossary's term choices
    python -m translations quiz-ranks chNN       per question: the correct option's length rank (1 = longest)
                                                 in English and in the translation (keep them alike)
    python -m translations build [--lang ko]     write the translated notebooks and documents

docs/TRANSLATING.md walks a translator through them.
"""
from __future__ import annotations

import argparse
import json
import sys

import translations as tr


def check(lang: str) -> int:
    found, extra = tr.problems(lang), tr.extra_entries(lang)
    for problem in found:
        print(problem.report())
    for entry in extra:
        print(f"{entry}: no English unit has this id any more; delete the entry")
    total = sum(len(units) for _, units in tr.english_sources())
    print(f"{lang}: {total - len(found)} of {total} units translated from today's English"
          + (f"; {len(found)} to do, {len(extra)} left over" if found or extra else ""))
    return 1 if found or extra else 0


def matching(lang: str, only: str):
    """(English source, its units, its translation file) for the sources whose path contains ``only``."""
    for english, units in tr.english_sources(only):
        yield english, units, tr.translation_file(lang, english)


def refresh(lang: str, ids: list[str], only: str) -> int:
    left = set(ids)
    for english, units, path in matching(lang, only):
        stored = tr.load_units(path)
        for unit in units:
            uid = tr.stored_id(english, unit)
            if uid in left and uid in stored:
                stored[uid].update(sha=tr.sha(unit.en), en=unit.en)
                left.discard(uid)
                tr.write_units(path, str(path.relative_to(tr.REPO)), list(stored.values()))
    for uid in sorted(left):
        print(f"no stored unit {uid!r} in a source matching {only!r}", file=sys.stderr)
    return 1 if left else 0


MARK = "=== "


def export(lang: str, only: str, everything: bool) -> int:
    for english, units, _ in matching(lang, only):
        print(f"{MARK}source {english.relative_to(tr.REPO)}")
        for unit in units:
            entry = tr.lookup(lang, english, unit)
            if everything or entry is None or entry["sha"] != tr.sha(unit.en) or not entry.get(lang, "").strip():
                print(f"{MARK}{tr.stored_id(english, unit)}\n{unit.en}")
    return 0


def import_blocks(lang: str, file: str, only: str) -> int:
    """Store each "=== ID" block of ``file`` as the translation of that unit; "=== source PATH"
    lines say which source the blocks after them belong to."""
    blocks: dict[str, dict[str, list[str]]] = {}
    source, current = "", None
    for line in open(file, encoding="utf-8").read().split("\n"):
        if line.startswith(MARK + "source "):
            source, current = line[len(MARK) + 7:].strip(), None
        elif line.startswith(MARK):
            current = blocks.setdefault(source, {}).setdefault(line[len(MARK):].strip(), [])
        elif current is not None:
            current.append(line)
    stored_count, unknown = 0, []
    wanted = [source for source in blocks if source] or [only]
    sources = {english: units for source in wanted for english, units in tr.english_sources(source)}
    for english, units in sources.items():
        rel = str(english.relative_to(tr.REPO))
        mine = {**blocks.get(rel, {}), **(blocks.get("", {}) if only and only in rel else {})}
        if not mine:
            continue
        path = tr.translation_file(lang, english)
        stored = tr.load_units(path)
        by_id = {tr.stored_id(english, u): u for u in units}
        for uid, lines in mine.items():
            if uid not in by_id:
                unknown.append(f"{rel}: {uid}")
                continue
            unit = by_id[uid]
            stored[uid] = {"id": uid, "sha": tr.sha(unit.en), "en": unit.en, lang: "\n".join(lines).strip("\n")}
            stored_count += 1
        tr.write_units(path, str(path.relative_to(tr.REPO)), list(stored.values()))
    for u in unknown:
        print(f"no English unit {u}", file=sys.stderr)
    print(f"{stored_count} translations stored")
    return 1 if unknown else 0


def quiz_ranks(lang: str, name: str) -> int:
    path = tr.REPO / "widgets" / "quizzes" / f"{name}.json"
    quiz = json.loads(path.read_text(encoding="utf-8"))
    def rank(texts: list[str], answer: int) -> int:
        return 1 + sum(1 for t in texts if len(t) > len(texts[answer]))
    for i, q in enumerate(quiz["questions"], 1):
        answer = next(j for j, o in enumerate(q["options"]) if o["correct"])
        en = [o["text"] for o in q["options"]]
        ko = [(tr.lookup(lang, path, tr.Unit(f"q{i}.o{j}", t)) or {}).get(lang, "") for j, t in enumerate(en, 1)]
        print(f"q{i}: English rank {rank(en, answer)}, {lang} rank {rank(ko, answer) if all(ko) else '-'}"
              f"  (lengths en {[len(t) for t in en]}, {lang} {[len(t) for t in ko]})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m translations", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["check", "glossary", "quiz-ranks", "refresh", "export", "import", "build"])
    parser.add_argument("ids", nargs="*", help="export, glossary: a filter on the source path; refresh: unit ids; import: the file")
    parser.add_argument("--lang", default="ko", choices=tr.LANGUAGES[1:])
    parser.add_argument("--source", default="", help="refresh, import: only sources whose path contains this")
    parser.add_argument("--all", action="store_true", help="export: every unit, translated or not")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check(args.lang)
    if args.command == "glossary":
        found = tr.glossary_problems(args.lang, args.ids[0] if args.ids else "")
        print("\n".join(found) or "glossary: every translated unit follows it")
        return 1 if found else 0
    if args.command == "quiz-ranks":
        return quiz_ranks(args.lang, args.ids[0])
    if args.command == "refresh":
        return refresh(args.lang, args.ids, args.source)
    if args.command == "export":
        return export(args.lang, args.ids[0] if args.ids else "", args.all)
    if args.command == "import":
        return import_blocks(args.lang, args.ids[0], args.source)
    for path in tr.build(args.lang):
        print(f"wrote {path.relative_to(tr.REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
