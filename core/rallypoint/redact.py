"""Keeping secrets out of what rallypoint prints.

Passwords reach rallypoint in ``--rdzv-conf`` (options declared ``secret=True``, which are
never printed), in the environment (``REDIS_PASSWORD``, read, never printed) and inside
endpoint URLs (``redis://user:password@host``). Every message that shows an endpoint shows
it through ``redact_endpoint``; the CLI passes each error line through ``redact_urls`` as
well, a safety net for a message built elsewhere (a plugin's, a client library's).
"""

from __future__ import annotations

import re

#: What a secret is shown as.
MASK = "***"

# scheme://user:password@ -> scheme://user:***@ (the password may hold "@": the last one
# before the host ends it, as urllib.parse reads it).
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:'\",]*):[^\s'\",]*@")


def redact_endpoint(endpoint: str) -> str:
    """``endpoint`` fit to print: in each comma-separated item, the password of a
    ``[scheme://]user:password@host`` is replaced by ``***`` (a user name stays: it helps
    to find the mistake, and it is no secret)."""
    return ",".join(_redact_item(item) for item in endpoint.split(","))


def _redact_item(item: str) -> str:
    scheme, sep, rest = item.partition("://")
    if not sep:
        scheme, rest = "", item
    if "@" not in rest:
        return item
    userinfo, _, host = rest.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if not colon:
        return item
    return f"{scheme}{sep}{user}:{MASK}@{host}"


def redact_urls(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` URL in it masked."""
    return _URL_PASSWORD.sub(lambda match: f"{match['head']}:{MASK}@", text)
