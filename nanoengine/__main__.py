"""Command line: ``python -m nanoengine {generate,chat,bench,serve}``.

    python -m nanoengine generate "The capital of France is" --max-tokens 20 --stream
    python -m nanoengine chat                      # type messages, /exit to leave
    python -m nanoengine bench                     # engine vs transformers, writes results JSON
    python -m nanoengine serve                     # OpenAI-compatible server on 127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import sys

from nanoengine.entrypoints.openai.cli_args import add_arguments as add_serve_arguments


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser; ``bench``'s options only when ``argv`` (None: ``sys.argv[1:]``) runs ``bench``:
    they come from ``nanobench``, which imports torch (seconds), and ``--help`` need not pay for it."""
    words = sys.argv[1:] if argv is None else argv
    command = next((w for w in words if not w.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="python -m nanoengine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _sampling_args(gen)
    chat = sub.add_parser("chat", help="interactive chat on stdin")
    chat.add_argument("--system", default=None, help="a system prompt")
    _sampling_args(chat)
    bench = sub.add_parser("bench", help="throughput against Hugging Face transformers")
    if command == "bench":
        from nanobench.benchmark import add_arguments  # the one import of nanobench in nanoengine

        add_arguments(bench)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_serve_arguments(serve)  # argparse only: no web stack imported
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        if args.command == "bench":
            from nanobench.benchmark import run_from_args

            args.command_line = "python -m nanoengine " + " ".join(argv)  # recorded in the results
            run_from_args(args)
            return 0
        if args.command == "serve":
            from nanoengine.entrypoints.openai.cli_args import run as serve

            serve(args)
            return 0
        from nanoengine import LLM, SamplingParams

        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                max_tokens=args.max_tokens, seed=args.seed)
        llm = LLM(args.model, device=args.device)
        if args.command == "generate":
            prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt  # a conversation
            if args.stream:
                for delta in llm.stream(prompt, params):
                    print(delta, end="", flush=True)
                print()
            else:
                print(llm.generate([prompt], params)[0].text)
            return 0
        return _chat_loop(llm, params, args.system)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _chat_loop(llm, params, system: str | None) -> int:
    messages = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        print("assistant> ", end="", flush=True)
        reply = []
        for delta in llm.stream(messages, params):
            reply.append(delta)
            print(delta, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


if __name__ == "__main__":
    sys.exit(main())
