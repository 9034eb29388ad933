#!/usr/bin/env bash
# The image's user: uid 1000, named maxtext, home /home/maxtext (JAX's compilation cache lives there).
# Ubuntu 24.04 images, NGC's JAX images among them, may already carry a uid-1000 user (`ubuntu`): it is
# renamed, with its home and group, rather than a second uid-1000 user added (useradd refuses: "UID 1000
# is not unique").
set -euo pipefail
existing="$(getent passwd 1000 | cut -d: -f1 || true)"
if [[ -z "$existing" ]]; then
  useradd --create-home --uid 1000 maxtext
elif [[ "$existing" != maxtext ]]; then
  usermod --login maxtext --home /home/maxtext --move-home "$existing"
  if getent group "$existing" >/dev/null; then
    groupmod --new-name maxtext "$existing"
  fi
fi
