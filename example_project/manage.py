#!/usr/bin/env python
"""The cinema site's manage.py: ``python example_project/manage.py COMMAND`` from any directory."""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main():
    # The project's packages (cinema_site, cinema) live beside this file; the repository
    # root comes next, so a checkout runs its own django_txqueue even without installing it.
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cinema_site.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
