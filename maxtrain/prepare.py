"""Entry point: python -m maxtrain.prepare CONFIG.yml train_files=GLOBS prepared_dir=DIR [key=value ...]

Tokenizes a corpus once, in worker processes, into shards that training reads by index
(dataset_type=prepared train_files=DIR): no tokenizing on the training hosts, a global shuffle. The work
lives in maxtrain.data.prepare.
"""

from __future__ import annotations

import sys

USAGE = """usage: python -m maxtrain.prepare CONFIG.yml train_files=GLOBS prepared_dir=DIR [key=value ...]

Tokenizes train_files (comma-separated globs, local or gs://: .txt, .jsonl, .jsonl.gz, .jsonl.zst,
.parquet, .array_record) with the config's tokenizer (tokenizer_type, tokenizer_path, add_bos, add_eos,
text_field) into shards of token ids under prepared_dir, in prepare_workers processes (default: one per
core). Interrupted, the same command resumes where it stopped. Then train on it:
    python -m maxtrain.train CONFIG.yml dataset_type=prepared train_files=DIR ..."""


def main(argv: list[str] | None = None) -> int:
    # Imported here, not above: the worker processes (spawned) import this module again, and need neither
    # jax nor the config.
    from maxtrain.config import help as cli_help, load as config_lib
    from maxtrain.runtime import errors
    argv = sys.argv[1:] if argv is None else argv
    if (code := cli_help.handle(argv, USAGE)) is not None:
        return code

    def run():
        from maxtrain.data import prepare
        prepare.run(config_lib.load(argv))
    return errors.exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
