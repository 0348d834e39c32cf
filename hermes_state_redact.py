"""Best-effort redaction of secrets in exports: the patterns (SECRET_PATTERNS, one table),
`redact_text` for a string and `redact` for a whole export.

Owns what counts as a secret and how it is masked. Must not touch a store: it works on export dicts
only (write_export calls it before rendering), and masks nothing under ID_KEYS, so a redacted export
still imports. Best effort, not a guarantee; see docs/moving-history.md on what --redact covers.
"""

import functools
import json
import re

from hermes_state_common import BYTES_MARKER

REDACTED = "[REDACTED]"

# A name that says its value is a secret: it holds one of the words, or its last part (after _ . -
# or a camelCase hump) is one of the tails. "DB_PASS", "x-auth-token", "AccountKey" and
# "aws_secret_access_key" are such names; "token_count", "max_tokens" and "monkey" are not. Case
# does not matter.
_SECRET_WORDS = ("passw(?:or)?d|passphrase|passcode|secret|credential|private[_.-]?key"
                 "|api[_.-]?key|access[_.-]?key|cookie")
_SECRET_TAILS = "key|token|pass|pwd|pw|pin|auth|authorization|sig|signature|dsn"
SECRET_NAME = (rf"(?:[\w.-]*(?:{_SECRET_WORDS})[\w.-]*"
               rf"|(?:[\w.-]*?(?:[_.-]|(?-i:(?<=[a-z0-9])(?=[A-Z]))))?(?:{_SECRET_TAILS}))")

# What follows such a name. A quoted value keeps its quotes ("...", '...', and \"...\" inside JSON
# held in a string); an Authorization scheme stays readable. An unquoted value after ":" or a spaced
# "=" (YAML, headers, INI, code) runs to the end of the line; after a tight "=" (env files, URL
# queries, connection strings) to the next space, quote or &.
_SCHEME = r"(?:(?:bearer|basic|token|bot|digest|negotiate|apikey)[ \t]+)?"
_QUOTED = (rf"(?:(?P<q>[\"']){_SCHEME}(?P<secret_q>(?:\\.|(?!(?P=q))[^\\\n])*)(?P=q)"
           rf"|\\(?P<eq>[\"']){_SCHEME}(?P<secret_e>(?:(?!\\(?P=eq)).)*)\\(?P=eq))")
_NAMED = rf"(?<![\w.-])(?P<nq>\\?[\"']?)(?:{SECRET_NAME})(?P=nq)"
_TO_LINE_END = rf"{_SCHEME}(?P<secret_l>(?:(?!\\[nrt\"])[^\r\n])+)"
_TO_WORD_END = r"(?P<secret_w>[^\s\"'&<>\\]+)"
# The needs (see below) of the patterns built on SECRET_NAME, and of AWS key ids.
_NAME_WORDS = ("pass", "pwd", "pw", "secret", "credential", "key", "token", "auth", "sig", "cookie",
               "dsn", "pin")
_AWS_KEY_IDS = ("akia", "asia", "abia", "acca")

# (name, example, needs, pattern): what each group named secret* matched is masked, the rest kept. A
# pattern runs only on text whose lower-case form holds one of its `needs`: a quick substring test
# that spares most text most patterns. Run in this order.
SECRET_PATTERNS = (
    ("private key block (PEM, OpenSSH, PGP), with or without its END line",
     "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n"
     "-----END OPENSSH PRIVATE KEY-----",
     ("private key",),
     r"(?s)(?P<secret>-----BEGIN[ A-Z0-9]*PRIVATE KEY(?: BLOCK)?-----"
     r"(?:.*?-----END[ A-Z0-9]*PRIVATE KEY(?: BLOCK)?-----|.*))"),
    ("PuTTY private key",
     "PuTTY-User-Key-File-3: ssh-ed25519\nPrivate-Lines: 1\nAAAAIEXAMPLE\nPrivate-MAC: 0a1b",
     ("putty-user-key-file",),
     r"(?s)(?P<secret>PuTTY-User-Key-File-\d+:(?:.*?Private-MAC: *[0-9a-f]+|.*))"),
    ("password in a URL (user:password@host, also :password@ and passwords holding @)",
     "redis://:p@ss@cache.internal:6379/0",
     ("://",),
     r"(?i)\b[a-z][a-z0-9+.-]*://[^\s:/@\"'<>]{0,256}:(?P<secret>[^\s\"'<>]{1,256}?)"
     r"@(?=(?:[\w.-]+|\[[0-9a-f:.]+\])(?::\d+)?(?:[/?#\s\"'<>\\,;)\]]|$))"),
    ("Slack webhook",
     "https://hooks.slack.com/services/T0EXAMPLE/B0EXAMPLE/abcdefghijklmnopqrstuvwx",
     ("hooks.slack.com",),
     r"hooks\.slack\.com/(?:services|workflows|triggers)/(?P<secret>[A-Za-z0-9/_-]+)"),
    ("Discord webhook",
     "https://discord.com/api/webhooks/123456789012345678/abcdefGHIJKL-mnopqrst_uvwx",
     ("/api/webhooks/",),
     r"discord(?:app)?\.com/api/webhooks/\d+/(?P<secret>[A-Za-z0-9_-]+)"),
    ("AWS access key id with its secret key beside it",
     "AKIAIOSFODNN7EXAMPLE,wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
     _AWS_KEY_IDS,
     r"(?<![A-Z0-9])(?P<secret>(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16})[\s,;:|\"']+"
     r"(?P<secret2>[A-Za-z0-9/+]{40})(?![A-Za-z0-9/+])"),
    ("AWS access key id",
     "AKIAIOSFODNN7EXAMPLE",
     _AWS_KEY_IDS,
     r"(?<![A-Z0-9])(?P<secret>(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16})(?![A-Z0-9])"),
    ("sk- keys: OpenAI (sk-, sk-proj-, sk-svcacct-), Anthropic (sk-ant-), OpenRouter, DeepSeek",
     "sk-ant-api03-EXAMPLEexampleEXAMPLEexample",
     ("sk-",),
     r"(?<![\w-])(?P<secret>sk-[A-Za-z0-9_-]{20,})"),
    ("Stripe keys and webhook secrets, sk_ keys (ElevenLabs)",
     "whsec_EXAMPLEexampleEXAMPLEexample",
     ("sk_", "rk_", "pk_", "whsec_"),
     r"(?<![\w-])(?P<secret>(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{10,}|sk_[A-Za-z0-9]{32,}"
     r"|whsec_[A-Za-z0-9+/=]{20,})"),
    ("GitHub tokens",
     "ghp_EXAMPLEexampleEXAMPLEexample012345",
     ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
     r"(?<![\w-])(?P<secret>gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"),
    ("GitLab tokens",
     "glpat-EXAMPLEexample012345",
     ("gl",),
     r"(?<![\w-])(?P<secret>gl(?:pat|dt|rt|ptt|ft|imt|oas|cbt|soat|agent)-[A-Za-z0-9_-]{20,})"),
    ("Slack tokens",
     "xapp-1-A0EXAMPLE-1234567890-abcdef0123456789",
     ("xox", "xapp-"),
     r"(?<![\w-])(?P<secret>xox[a-z](?:\.xox[a-z])?-[A-Za-z0-9-]{10,}|xapp-\d-[A-Za-z0-9-]{10,})"),
    ("Discord bot token",
     "MTIzNDU2Nzg5MDEyMzQ1Njc4.GaBcDe.EXAMPLEexampleEXAMPLEexample0123",
     (".",),
     r"(?<![\w-])(?P<secret>[MNO][A-Za-z0-9_-]{23,27}\.[A-Za-z0-9_-]{6}\."
     r"[A-Za-z0-9_-]{27,40})(?![\w-])"),
    ("Telegram bot token",
     "123456789:AAEXAMPLEexampleEXAMPLEexample01234",
     (":",),
     r"(?<!\d)(?P<secret>\d{6,12}:[A-Za-z0-9_-]{30,})(?![\w-])"),
    ("SendGrid key",
     "SG.EXAMPLEexample012345.EXAMPLEexampleEXAMPLEexampleEXAMPLEexample0",
     ("sg.",),
     r"(?<![\w-])(?P<secret>SG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,})"),
    ("Twilio account and key ids",
     "SK0123456789abcdef0123456789abcdef",
     ("ac", "sk"),
     r"(?<![\w-])(?P<secret>(?:AC|SK)[0-9a-f]{32})(?![\w-])"),
    ("Google API key, OAuth client secret, access and refresh tokens",
     "GOCSPX-EXAMPLEexampleEXAMPLEexam",
     ("aiza", "gocspx-", "ya29.", "1//0"),
     r"(?<![\w-])(?P<secret>AIza[0-9A-Za-z_-]{35}|GOCSPX-[A-Za-z0-9_-]{20,}"
     r"|ya29\.[A-Za-z0-9_-]{20,}"
     r"|1//0[A-Za-z0-9_-]{30,})"),
    ("Azure AD client secret",
     "abc8Q~EXAMPLEexampleEXAMPLEexample012",
     ("q~",),
     r"(?<![\w~.-])(?P<secret>[A-Za-z0-9_~.-]{3}\dQ~[A-Za-z0-9_~.-]{31,34})"),
    ("Hugging Face, npm, PyPI tokens",
     "hf_EXAMPLEexampleEXAMPLEexample0123",
     ("hf_", "api_org_", "npm_", "pypi-"),
     r"(?<![\w-])(?P<secret>hf_[A-Za-z0-9]{30,}|api_org_[A-Za-z0-9]{30,}|npm_[A-Za-z0-9]{36}"
     r"|pypi-[A-Za-z0-9_-]{50,})"),
    ("AI services: Groq, xAI, Replicate, Perplexity, Tavily, Firecrawl, LangSmith, Fireworks, "
     "NVIDIA",
     "gsk_EXAMPLEexampleEXAMPLEexampleEXAMPLEexample01",
     ("gsk_", "xai-", "r8_", "pplx-", "tvly-", "fc-", "lsv2_", "fw_", "nvapi-"),
     r"(?<![\w-])(?P<secret>gsk_[A-Za-z0-9]{40,}|xai-[A-Za-z0-9]{40,}|r8_[A-Za-z0-9]{30,}"
     r"|pplx-[A-Za-z0-9]{40,}"
     r"|tvly-(?:dev-)?[A-Za-z0-9]{20,}|fc-[a-f0-9]{32}|lsv2_(?:pt|sk)_[a-f0-9]{32}_[a-f0-9]{10}"
     r"|fw_[A-Za-z0-9]{20,}|nvapi-[A-Za-z0-9_-]{40,})"),
    ("developer services: Shopify, DigitalOcean, Vault, Postman, Atlassian, Mailgun, Mailchimp, "
     "Sentry, Databricks, Linear, Notion, Square, Grafana, Doppler, Heroku",
     "dapi0123456789abcdef0123456789abcdef",
     ("shp", "_v1_", "hvs.", "hvb.", "pmak-", "atatt", "key-", "-us", "sntr", "dapi", "lin_",
      "secret_", "ntn_", "sq0", "eaaa", "gls", "glc_", "dp.", "hrku-"),
     r"(?<![\w-])(?P<secret>shp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}|do[opr]_v1_[a-f0-9]{64}"
     r"|hv[sb]\.[A-Za-z0-9_-]{24,}"
     r"|PMAK-[a-f0-9]{24}-[a-f0-9]{34}|ATATT[A-Za-z0-9_=-]{50,}|key-[0-9a-f]{32}"
     r"|[0-9a-f]{32}-us\d{1,2}"
     r"|sntr[ysu]_[A-Za-z0-9+/=_]{30,}|dapi[0-9a-f]{32}|lin_(?:api|oauth)_[A-Za-z0-9]{40}"
     r"|(?:secret|ntn)_[A-Za-z0-9]{40,}|(?:sq0atp|sq0csp|EAAA)[A-Za-z0-9_-]{22,}"
     r"|glsa_[A-Za-z0-9_]{32,}"
     r"|glc_[A-Za-z0-9+/=]{30,}|dp\.(?:st|pt|ct|sa)\.[A-Za-z0-9_.-]{40,}|HRKU-[A-Za-z0-9_-]{30,})"),
    ("JSON Web Token",
     "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJlLWV4YW1wbGU",
     ("eyj",),
     r"(?<![\w-])(?P<secret>eyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*)"),
    ("secret name, then : or = and a value "
     "(env, YAML, JSON, TOML, INI, headers, code, URL queries)",
     'db:\n  password: "pa ss w0rd"\nexport AZURE_OPENAI_KEY=0123456789abcdef',
     _NAME_WORDS,
     rf"(?i){_NAMED}(?:[ \t]*(?::=|=>|:(?!//)|=)[ \t]*{_QUOTED}"
     rf"|(?:[ \t]*(?::=|=>|:(?!//))[ \t]*|[ \t]+=[ \t]*|=[ \t]+){_TO_LINE_END}"
     rf"|=(?![=\s]){_TO_WORD_END})"),
    ("name/value pair with a secret name (JSON environment and header lists)",
     '{"name": "DB_PASSWORD", "value": "hunter2"}',
     ("value",),
     rf"(?i)(?P<nq>\\?[\"'])(?:name|key)(?P=nq)[ \t]*:[ \t]*"
     rf"(?P=nq)(?:{SECRET_NAME})(?P=nq)[ \t]*,[ \t]*"
     rf"(?P=nq)value(?P=nq)[ \t]*:[ \t]*(?:{_QUOTED}|{_TO_WORD_END})"),
    ("name/value pair with a secret name (YAML environment lists)",
     "- name: DB_PASSWORD\n  value: hunter2",
     ("value",),
     rf"(?i)\bname:[ \t]*[\"']?(?:{SECRET_NAME})[\"']?\s+value:[ \t]*(?:{_QUOTED}|{_TO_LINE_END})"),
    ("command-line option with a secret name, also in an argument list",
     "mysql --password hunter2 -h db",
     _NAME_WORDS,
     rf"(?i)(?<![\w.-])--?(?:{SECRET_NAME})(?:[ \t]+|\\?[\"'][ \t]*,[ \t]*)(?!-)"
     rf"(?:{_QUOTED}|{_TO_WORD_END})"),
    ("curl -u user:password",
     "curl -u admin:hunter2 https://example.com",
     ("-u", "--user"),
     r"(?:\s-u|--user)[ \t]*[\"']?[^\s:\"']*:(?P<secret>[^\s\"']+)"),
    (".netrc line",
     "machine api.example.com login bob password hunter2",
     ("machine",),
     r"(?i)\bmachine[ \t]+\S+(?:[ \t]+login[ \t]+\S+)?[ \t]+password[ \t]+(?P<secret>\S+)"),
    ("password said in prose",
     "the password is 'swordfish'",
     ("pass", "pwd"),
     r"(?i)\b(?:pass(?:word|phrase|code)|passwd|pwd)[ \t]+(?:is|was|:|=|->)[ \t]+"
     r"(?:(?P<pq>[\"'`])(?P<secret_q>[^\"'`\n]+)(?P=pq)|(?P<secret>[^\s\"'`]+))"),
    ("password followed by a word with a digit",
     "password Pa55w0rd",
     ("pass", "pwd"),
     r"(?i)\b(?:pass(?:word|phrase|code)|passwd|pwd)[ \t]+"
     r"[\"'`]?(?P<secret>(?=[^\s\"'`]*\d)[^\s\"'`]{4,})"),
    ("token, secret or key said in prose, when the value looks like one",
     "my api key is 0123456789abcdef",
     ("secret", "token", "key"),
     r"(?i)\b(?:secret|token|api[ _-]?key|access[ _-]?key|key)"
     r"[ \t]+(?:is|was|:|=|->)[ \t]+[\"'`]?"
     r"(?P<secret>(?=[^\s\"'`]*\d)[^\s\"'`]{8,}|[^\s\"'`]{16,})"),
    ("bearer token anywhere",
     "curl -H 'Authorization: Bearer abc123def456'",
     ("bearer",),
     r"(?i)\bbearer[ \t]+(?P<secret>(?=[A-Za-z0-9._~+/=-]*\d)[A-Za-z0-9._~+/=-]{8,})"),
)


@functools.lru_cache(maxsize=None)
def compiled_patterns():
    """SECRET_PATTERNS as ((needs, regex), ...), compiled at the first redaction, not at import:
    compiling them took longer than the rest of `import hermes_state`, which every agent start
    pays and few runs redact."""
    return tuple((needs, re.compile(pattern))
                 for _name, _example, needs, pattern in SECRET_PATTERNS)


@functools.lru_cache(maxsize=None)
def _secret_name_regex(option=False):
    """SECRET_NAME compiled, any case; `option`: as a command-line option (-name, --name)."""
    return re.compile(rf"--?(?:{SECRET_NAME})" if option else SECRET_NAME, re.I)


# Keys of an export whose values identify something (ids, roles, models, sources): never masked,
# wherever they sit in the export. JSON inside a string has no such keys.
ID_KEYS = frozenset({"id", "session_id", "parent_session_id", "tool_call_id", "lineage_session_ids",
                     "system_prompt_hash", "role", "model", "source", "session_key", BYTES_MARKER})
# Past this depth a value is masked whole instead of walked: the walk recurses.
REDACT_MAX_DEPTH = 100


def _mask(match):
    """The match with every secret* group that took part replaced by REDACTED."""
    spans = sorted(match.span(name) for name, value in match.groupdict().items()
                   if name.startswith("secret") and value)
    text, position, parts = match.string, match.start(), []
    for start, end in spans:
        parts += [text[position:start], REDACTED]
        position = end
    parts.append(text[position:match.end()])
    return "".join(parts)


def redact_text(text):
    """`text` with every secret SECRET_PATTERNS recognises replaced by [REDACTED].
    Best effort, not a guarantee; see docs/moving-history.md on what --redact covers."""
    lowered = text.lower()
    for needs, pattern in compiled_patterns():
        if any(need in lowered for need in needs):
            text = pattern.sub(_mask, text)
    return text


def redact(export):
    """A copy of an export with every secret masked and every identifier (ID_KEYS) kept: strings
    through redact_text, a value whose key is a secret name (api_key, DB_PASS, X-API-Key, ...)
    masked whole, JSON held in a string (tool arguments, model_config) walked as JSON, so its keys
    count too."""
    return _redact(export, None, ID_KEYS, 0)


def _is_secret_value(value):
    if isinstance(value, str):
        return value not in ("", REDACTED)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _redact(value, key, exempt, depth):
    if key in exempt:
        return value
    if depth > REDACT_MAX_DEPTH:
        return REDACTED
    if isinstance(key, str) and _is_secret_value(value) and _secret_name_regex().fullmatch(key):
        return REDACTED
    if isinstance(value, str):
        return _redact_string(value, depth)
    if isinstance(value, dict):
        return _redact_mapping(value, exempt, depth + 1)
    if isinstance(value, list):
        return _redact_list(value, key, exempt, depth + 1)
    return value


def _redact_string(text, depth):
    """JSON text walked as JSON, written back only if something was masked; other text
    through redact_text."""
    if text.lstrip()[:1] in ("{", "["):
        try:
            decoded = json.loads(text)
        except (ValueError, RecursionError):
            decoded = None
        if isinstance(decoded, (dict, list)):
            cleaned = _redact(decoded, None, frozenset(), depth + 1)
            return text if cleaned == decoded else json.dumps(cleaned, ensure_ascii=False)
    return redact_text(text)


def _redact_mapping(mapping, exempt, depth):
    """Each value under its own key; in a {"name": <secret name>, "value": ...} pair
    (environment lists, header lists) the value is masked too."""
    label = mapping.get("name", mapping.get("key"))
    paired = isinstance(label, str) and _secret_name_regex().fullmatch(label) is not None
    return {key: REDACTED if paired and key == "value" and _is_secret_value(value)
            else _redact(value, key, exempt, depth) for key, value in mapping.items()}


def _redact_list(items, key, exempt, depth):
    """Each item under the list's key; in an argument list, the item after a secret option too."""
    cleaned, after_option = [], False
    for item in items:
        if after_option and _is_secret_value(item):
            cleaned.append(REDACTED)
        else:
            cleaned.append(_redact(item, key, exempt, depth))
        after_option = (isinstance(item, str)
                        and _secret_name_regex(option=True).fullmatch(item) is not None)
    return cleaned
