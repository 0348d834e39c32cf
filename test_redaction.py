"""Redaction: a corpus of secrets, placed in every part of a session, through every export format.

Each corpus entry is a text as people paste it (an env file, a YAML block, a header, a URL,
a key file, a sentence) and the secret values inside it. Every entry goes into each of the
eight places a session holds free text; every session is exported in every format with and
without --redact. A placement counts when the plain export shows the secret; it leaks when
the redacted export still shows any piece of it. Identifiers must come through unchanged.
"""

import html
import json
import random
import string

from hermes_state_common import normalize_title
from hermes_state_export_formats import markdown_text
from hermes_state_portability import EXPORT_FORMATS, markdown_file_name, write_export
from hermes_state_redact import SECRET_PATTERNS, redact_text
from test_support import StoreTestCase

RNG = random.Random(13)
ALNUM = string.ascii_letters + string.digits
URLSAFE = ALNUM + "-_"
HEX = "0123456789abcdef"
UPPER = string.ascii_uppercase + string.digits
B64 = ALNUM + "+/"


def rand(alphabet, length):
    return "".join(RNG.choice(alphabet) for _ in range(length))


def pem(label, end=True):
    body = "\n".join(rand(B64, 64) for _ in range(4))
    block = f"-----BEGIN {label}-----\n{body}\n"
    return (block + f"-----END {label}-----" if end else block), body.split("\n")


def corpus():
    """[(name, text, [secret values])]: vendors' documented key shapes, then generic forms."""
    entries = []

    def add(name, text, *secrets):
        entries.append((name, text, list(secrets)))

    # Vendor key shapes, bare and in the places they usually sit.
    s = "sk-" + rand(ALNUM, 48)
    add("openai legacy key", f"OPENAI_API_KEY={s}", s)
    s = "sk-proj-" + rand(URLSAFE, 120)
    add("openai project key", f"client = OpenAI(api_key='{s}')", s)
    s = "sk-svcacct-" + rand(URLSAFE, 60)
    add("openai service account key", f"key: {s}", s)
    s = "sk-ant-api03-" + rand(URLSAFE, 93) + "AA"
    add("anthropic key", f"Use this: {s} thanks", s)
    s = "sk-ant-admin01-" + rand(URLSAFE, 80)
    add("anthropic admin key", f'{{"anthropic": "{s}"}}', s)
    s = "sk-or-v1-" + rand(HEX, 64)
    add("openrouter key", f"OPENROUTER_API_KEY: {s}", s)
    key_id, secret = "AKIA" + rand(UPPER, 16), rand(B64, 40)
    add("aws credentials file", f"[default]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n",
        key_id, secret)
    key_id, secret = "AKIA" + rand(UPPER, 16), rand(B64, 40)
    add("aws keys as csv", f"Access key ID,Secret access key\n{key_id},{secret}", key_id, secret)
    secret = rand(B64, 40)
    add("aws secret in yaml", f"aws:\n  aws_secret_access_key: {secret}\n  region: eu-west-1", secret)
    key_id, token = "ASIA" + rand(UPPER, 16), rand(B64, 300)
    add("aws session token env", f"AWS_ACCESS_KEY_ID={key_id}\nAWS_SESSION_TOKEN={token}", key_id, token)
    for prefix in ("ghp_", "gho_", "ghu_", "ghs_", "ghr_"):
        s = prefix + rand(ALNUM, 36)
        add(f"github {prefix} token", f"git clone https://{s}@github.com/org/repo.git", s)
    s = "github_pat_" + rand(ALNUM, 22) + "_" + rand(ALNUM, 59)
    add("github fine-grained token", f"GITHUB_TOKEN={s}", s)
    s = "glpat-" + rand(URLSAFE, 20)
    add("gitlab token", f"PRIVATE-TOKEN: {s}", s)
    s = f"xoxb-{rand(string.digits, 12)}-{rand(string.digits, 13)}-{rand(ALNUM, 24)}"
    add("slack bot token", f"SLACK_BOT_TOKEN={s}", s)
    s = f"xoxp-{rand(string.digits, 12)}-{rand(string.digits, 12)}-{rand(string.digits, 13)}-{rand(HEX, 32)}"
    add("slack user token", f"token {s}", s)
    s = f"xapp-1-A{rand(UPPER, 10)}-{rand(string.digits, 13)}-{rand(HEX, 64)}"
    add("slack app token", f"SLACK_APP_TOKEN: '{s}'", s)
    s = f"T{rand(UPPER, 8)}/B{rand(UPPER, 8)}/{rand(ALNUM, 24)}"
    add("slack webhook", f"curl -X POST https://hooks.slack.com/services/{s} -d '{{}}'", s)
    s = f"{rand('MNO', 1)}{rand(URLSAFE, 25)}.{rand(URLSAFE, 6)}.{rand(URLSAFE, 38)}"
    add("discord bot token", f"bot.run('{s}')", s)
    s = rand(URLSAFE, 68)
    add("discord webhook", f"https://discord.com/api/webhooks/{rand(string.digits, 18)}/{s}", s)
    s = f"{rand(string.digits, 10)}:AA{rand(URLSAFE, 33)}"
    add("telegram bot token in a url", f"https://api.telegram.org/bot{s}/sendMessage?chat_id=42", s)
    s = f"{rand(string.digits, 9)}:AA{rand(URLSAFE, 33)}"
    add("telegram bot token in env", f"TELEGRAM_BOT_TOKEN={s}", s)
    s = "sk_live_" + rand(ALNUM, 99)
    add("stripe secret key", f"Stripe::api_key = '{s}'", s)
    s = "rk_live_" + rand(ALNUM, 24)
    add("stripe restricted key", f"stripe key {s}", s)
    s = "whsec_" + rand(ALNUM, 32)
    add("stripe webhook secret", f"endpoint secret is {s}", s)
    s = f"SG.{rand(URLSAFE, 22)}.{rand(URLSAFE, 43)}"
    add("sendgrid key", f"SENDGRID_API_KEY='{s}'", s)
    sid, token = "AC" + rand(HEX, 32), rand(HEX, 32)
    add("twilio sid and auth token", f"TWILIO_ACCOUNT_SID={sid}\nTWILIO_AUTH_TOKEN={token}", sid, token)
    s = "SK" + rand(HEX, 32)
    add("twilio api key", f"api key sid {s}", s)
    s = "AIza" + rand(URLSAFE, 35)
    add("google api key in a url", f"https://maps.googleapis.com/maps/api/geocode/json?address=x&key={s}", s)
    s = "GOCSPX-" + rand(URLSAFE, 28)
    add("google oauth client secret", f'{{"web": {{"client_id": "1.apps.googleusercontent.com", '
                                      f'"client_secret": "{s}"}}}}', s)
    s = "ya29." + rand(URLSAFE, 150)
    add("google access token", f"access token: {s}", s)
    s = "1//0" + rand(URLSAFE, 60)
    add("google refresh token", f"refresh = {s}", s)
    key, key_lines = pem("PRIVATE KEY")
    add("google service account json", json.dumps({"type": "service_account", "private_key_id": rand(HEX, 40),
                                                   "private_key": key, "client_email": "x@p.iam.gserviceaccount.com"}),
        *key_lines)
    s = rand(HEX, 32)
    add("azure openai key env", f"AZURE_OPENAI_KEY={s}\nAZURE_OPENAI_ENDPOINT=https://x.openai.azure.com/", s)
    s = rand(HEX, 32)
    add("azure api-key header", f"api-key: {s}", s)
    s = rand(ALNUM, 3) + "8Q~" + rand(ALNUM + "_~.-", 34)
    add("azure ad client secret", f"the client secret value {s} expires in 2027", s)
    s = rand(B64, 86) + "=="
    add("azure storage connection string",
        f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={s};EndpointSuffix=core.windows.net", s)
    s = rand(ALNUM, 40) + "%3D"
    add("azure sas url", f"https://acct.blob.core.windows.net/c/b.txt?sv=2022-11-02&se=2030-01-01&sig={s}", s)
    s = "hf_" + rand(ALNUM, 34)
    add("hugging face token", f"huggingface-cli login --token {s}", s)
    s = "npm_" + rand(ALNUM, 36)
    add("npm token", f"//registry.npmjs.org/:_authToken={s}", s)
    s = "pypi-AgEIcHlwaS5vcmc" + rand(URLSAFE, 70)
    add("pypi token", f"[pypi]\n  username = __token__\n  password = {s}", s)
    s = "gsk_" + rand(ALNUM, 52)
    add("groq key", f"GROQ_API_KEY={s}", s)
    s = "xai-" + rand(ALNUM, 80)
    add("xai key", f"xai key {s}", s)
    s = "r8_" + rand(ALNUM, 37)
    add("replicate token", f"REPLICATE_API_TOKEN={s}", s)
    s = "pplx-" + rand(ALNUM, 48)
    add("perplexity key", s, s)
    s = "tvly-" + rand(ALNUM, 32)
    add("tavily key", f'{{"tavily_api_key": "{s}"}}', s)
    s = rand(ALNUM, 32)
    add("mistral key by name", f"MISTRAL_API_KEY={s}", s)
    s = "shpat_" + rand(HEX, 32)
    add("shopify token", f"X-Shopify-Access-Token: {s}", s)
    s = "dop_v1_" + rand(HEX, 64)
    add("digitalocean token", f"doctl auth init -t {s}", s)
    s = "hvs." + rand(URLSAFE, 90)
    add("vault token", f"VAULT_TOKEN={s}", s)
    s = "key-" + rand(HEX, 32)
    add("mailgun key", f"auth=('api', '{s}')", s)
    s = "dapi" + rand(HEX, 32)
    add("databricks token", f"databricks token {s}", s)
    s = "lin_api_" + rand(ALNUM, 40)
    add("linear key", s, s)
    header, payload, signature = rand(URLSAFE, 36), rand(URLSAFE, 120), rand(URLSAFE, 43)
    jwt = f"eyJ{header}.eyJ{payload}.{signature}"
    add("json web token", f"Cookie: auth={jwt}", jwt)
    add("json web token bare", f"here is the id token eyJ{header}.eyJ{payload}.{signature} ok", jwt)

    # Private key files.
    for label in ("RSA PRIVATE KEY", "EC PRIVATE KEY", "PRIVATE KEY", "ENCRYPTED PRIVATE KEY",
                  "OPENSSH PRIVATE KEY", "DSA PRIVATE KEY", "PGP PRIVATE KEY BLOCK"):
        key, lines = pem(label)
        add(f"{label.lower()} block", f"cat ~/.ssh/id\n{key}\n", *lines)
    key, lines = pem("RSA PRIVATE KEY", end=False)
    add("pem block without its end line", f"here is the start of it:\n{key}", *lines)
    key, lines = pem("OPENSSH PRIVATE KEY", end=False)
    add("openssh block cut short", key, *lines)
    lines = [rand(B64, 64) for _ in range(3)]
    add("putty key", "PuTTY-User-Key-File-3: ssh-ed25519\nEncryption: none\nComment: me\nPublic-Lines: 2\n"
        + "\n".join(lines) + "\nPrivate-Lines: 1\n" + lines[0][::-1] + f"\nPrivate-MAC: {rand(HEX, 64)}",
        *lines, lines[0][::-1])

    # Generic names: env, YAML, JSON, TOML, INI, code.
    for name in ("DB_PASS", "DB_PASSWORD", "PGPASSWORD", "MYSQL_PWD", "PRIVATE_KEY", "SECRET_KEY_BASE",
                 "JWT_SECRET", "REDIS_AUTH", "SESSION_SECRET", "ENCRYPTION_KEY", "SIGNING_KEY", "ADMIN_PASSPHRASE",
                 "SMTP_CREDENTIALS", "API_TOKEN", "ACCESS_TOKEN", "WEBHOOK_SIG"):
        s = rand(ALNUM + "!@#%^*", 24)
        add(f"env {name}", f"export {name}={s}", s)
    s = "pa ss w0rd with spaces"
    add("env quoted value with spaces", f'DB_PASSWORD="{s}"\nDB_USER=app', s)
    s = rand(ALNUM, 12) + " " + rand(ALNUM, 12)
    add("env single-quoted value", f"API_TOKEN='{s}'", s)
    s = rand(ALNUM, 16)
    add("yaml password", f"database:\n  user: app\n  password: {s}\n  host: db", s)
    s = "correct horse battery " + rand(ALNUM, 6)
    add("yaml unquoted value with spaces", f"client_secret: {s}", s)
    s = rand(ALNUM, 10) + " " + rand(ALNUM, 10)
    add("yaml quoted value", f"api_key: \"{s}\"\nmodel: gpt-4o", s)
    s = rand(B64, 24)
    add("kubernetes secret data", f"kind: Secret\ndata:\n  password: {s}\n  username: YWRtaW4=", s)
    s = rand(ALNUM, 20)
    add("json password", json.dumps({"user": "app", "password": s}), s)
    s = rand(ALNUM, 20)
    add("json camelCase key", json.dumps({"apiKey": s, "region": "us"}), s)
    s = rand(ALNUM, 20)
    add("json nested auth", json.dumps({"auth": {"username": "u", "password": s}}), s)
    s = rand(string.digits, 8)
    add("json numeric pin", '{"pin": %s, "card": "visa"}' % s, s)
    s = rand(ALNUM, 20)
    add("json env list", json.dumps({"env": [{"name": "DB_PASSWORD", "value": s}, {"name": "DEBUG", "value": "1"}]}), s)
    s = rand(ALNUM, 20)
    add("yaml env list", f"env:\n  - name: LOG_LEVEL\n    value: info\n  - name: DB_PASSWORD\n    value: {s}\n", s)
    s = rand(ALNUM, 20)
    add("json inside a json string", json.dumps({"arguments": json.dumps({"token": s})}), s)
    s = rand(ALNUM, 20)
    add("escaped json in text", 'response body: {\\"access_token\\": \\"' + s + '\\", \\"expires_in\\": 3600}', s)
    s = rand(ALNUM, 20)
    add("argv list", json.dumps({"argv": ["mysql", "-h", "db", "--password", s]}), s)
    s = rand(ALNUM, 20)
    add("toml password", f'[database]\npassword = "{s}"\nport = 5432', s)
    s = rand(ALNUM, 20)
    add("toml single quotes", f"api_key = '{s}'", s)
    s = "pa ss " + rand(ALNUM, 10)
    add("ini value with spaces", f"[db]\npassword = {s}\nuser = bob", s)
    s = rand(ALNUM, 20)
    add("python keyword argument", f"conn = psycopg.connect(host='db', password='{s}')", s)
    s = rand(ALNUM, 20)
    add("javascript constant", f"const apiKey = '{s}';", s)
    s = rand(HEX, 64)
    add("high-entropy value after a name", f"webhook_secret: {s}", s)

    # HTTP headers and command lines.
    s = rand(URLSAFE, 40)
    add("authorization bearer", f"Authorization: Bearer {s}", s)
    s = rand(B64, 28) + "=="
    add("authorization basic", f"Authorization: Basic {s}", s)
    s = rand(URLSAFE, 32)
    add("x-api-key header", f"X-API-Key: {s}", s)
    s = rand(URLSAFE, 32)
    add("x-auth-token header", f"x-auth-token:{s}", s)
    s, t = rand(URLSAFE, 32), rand(URLSAFE, 32)
    add("cookie header", f"Cookie: sessionid={s}; csrftoken={t}", s, t)
    s = rand(URLSAFE, 32)
    add("set-cookie header", f"Set-Cookie: sid={s}; Path=/; HttpOnly", s)
    s = rand(URLSAFE, 32)
    add("proxy authorization", f"Proxy-Authorization: Basic {s}", s)
    s = rand(URLSAFE, 32)
    add("curl with a header", f'curl -s -H "Authorization: Bearer {s}" https://api.example.com/v1/me', s)
    s = rand(ALNUM, 16)
    add("curl user and password", f"curl -u admin:{s} https://example.com/api", s)
    s = rand(ALNUM, 16)
    add("command-line password option", f"pg_dump --password {s} --host db app", s)
    s = rand(ALNUM, 16)
    add("headers as a json object", json.dumps({"headers": {"X-Api-Key": s, "Accept": "*/*"}}), s)

    # URLs.
    s = rand(ALNUM, 16)
    add("postgres url", f"DATABASE_URL=postgres://app:{s}@db.internal:5432/app", s)
    s = "p@ss" + rand(ALNUM, 8) + "@w0rd"
    add("url password holding @", f"see https://admin:{s}@example.com/login for details", s)
    s = rand(ALNUM, 16)
    add("redis url without user", f"REDIS_URL=redis://:{s}@cache:6379/0", s)
    s = rand(ALNUM, 16)
    add("mongodb srv url", f"mongodb+srv://user:{s}@cluster0.abcde.mongodb.net/?retryWrites=true", s)
    s = rand(ALNUM, 16)
    add("amqp url", f"amqp://guest:{s}@rabbit/", s)
    s = rand(ALNUM, 16)
    add("url password holding a slash", f"https://deploy:ab/{s}@git.example.com/repo.git", s)
    s = rand(ALNUM, 24)
    add("url query api_key", f"GET https://api.example.com/v1/items?api_key={s}&format=json", s)
    s = rand(URLSAFE, 24)
    add("url query access_token", f"https://graph.example.com/me?fields=id&access_token={s}", s)

    # Prose.
    s = "Pa" + rand(ALNUM, 4) + "w0rd"
    add("password then a word with a digit", f"password {s}", s)
    s = rand(string.ascii_lowercase, 9)
    add("my password is", f"my password is {s}, do not share", s)
    s = "correct horse " + rand(string.ascii_lowercase, 7)
    add("the passphrase is quoted", f"The passphrase is '{s}' for the vault", s)
    s = rand(HEX, 32)
    add("api key said in prose", f"Your API key is {s}.", s)
    s = rand(ALNUM, 10) + "9"
    add("token said in prose", f"the token: {s}", s)
    s = rand(ALNUM, 12)
    add("netrc", f"machine api.example.com login bob password {s}", s)
    return entries


PLACES = ("content", "tool_arguments", "tool_output", "reasoning", "title", "system_prompt", "model_config", "cwd")
MODELS = ("claude-sonnet-4-20250514", "gpt-4o-2024-08-06", "openai/gpt-5", "sk-ant-looks-like-a-key-model-0001")


def session(index, texts):
    """A session holding each text of `texts` ({place: text}) in its place; a title too long
    to be one (over 100 characters) is left out."""
    t0 = 1000.0 + index
    call = {"id": f"call_{index}", "type": "function",
            "function": {"name": "terminal", "arguments": json.dumps({"command": texts["tool_arguments"]})}}
    entry = {"id": f"s{index:03d}", "source": "cli", "model": MODELS[index % len(MODELS)], "started_at": t0,
             "ended_at": t0 + 9, "end_reason": "user_exit", "system_prompt": texts["system_prompt"],
             "model_config": {"temperature": 0.2, "notes": texts["model_config"]}, "cwd": texts["cwd"],
             "messages": [
                 {"role": "user", "content": f"Before.\n{texts['content']}\nAfter.", "timestamp": t0 + 1},
                 {"role": "assistant", "content": "Done.", "reasoning": texts["reasoning"], "tool_calls": [call],
                  "timestamp": t0 + 2},
                 {"role": "tool", "content": texts["tool_output"], "tool_call_id": call["id"], "tool_name": "terminal",
                  "timestamp": t0 + 3}]}
    title = " ".join(f"{index} {texts['title']}".split())
    if len(title) <= 100:
        entry["title"] = normalize_title(title)
    return entry


def pieces(secret):
    """The secret and, for a long one, three 10-character pieces of it: a piece left
    behind is a leak too."""
    if len(secret) < 16:
        return [secret]
    middle = len(secret) // 2 - 5
    return [secret, secret[:10], secret[middle:middle + 10], secret[-10:]]


def forms(piece):
    """How a piece can appear in an export: as is, JSON-escaped (once or twice), HTML-escaped,
    as Markdown text (md and qmd)."""
    once = json.dumps(piece)[1:-1]
    return {piece, once, json.dumps(once)[1:-1], html.escape(piece), html.escape(piece, quote=False),
            markdown_text(piece)}


def by_session(fmt, path):
    """{session id: the text of the export that belongs to it}."""
    if fmt == "jsonl":
        return {json.loads(line)["id"]: line for line in path.read_text(encoding="utf-8").splitlines()}
    if fmt == "trace":
        parts = {}
        for line in path.read_text(encoding="utf-8").splitlines():
            parts.setdefault(json.loads(line)["session_id"], []).append(line)
        return {session_id: "\n".join(lines) for session_id, lines in parts.items()}
    if fmt == "html":
        sections = path.read_text(encoding="utf-8").split('<section class="session" id="')[1:]
        return {html.unescape(section.split('"', 1)[0]): section for section in sections}
    manifest = [json.loads(line) for line in (path / "manifest.jsonl").read_text(encoding="utf-8").splitlines()]
    return {entry["session_id"]: (path / entry["file"]).read_text(encoding="utf-8") for entry in manifest}


class RedactionCorpus(StoreTestCase):

    def test_no_secret_of_the_corpus_leaks_from_any_place_or_format(self):
        # Each place gets its own draw of the corpus, so that a secret names its place.
        draws = {place_name: corpus() for place_name in PLACES}
        entries, secret_places = [], {}
        for index in range(len(draws["content"])):
            entries.append(session(index, {p: draws[p][index][1] for p in PLACES}))
            secret_places[entries[-1]["id"]] = [(p, draws[p][index][0], s) for p in PLACES for s in draws[p][index][2]]
        result = self.db.import_sessions(entries)
        self.assertTrue(result["ok"], result["errors"][:3])
        checked, leaks, places_seen = 0, [], set()
        for fmt in EXPORT_FORMATS:
            plain_out, redacted_out = self.tmp / f"plain.{fmt}", self.tmp / f"redacted.{fmt}"
            write_export(self.db.export_all(), fmt, str(plain_out))
            write_export(self.db.export_all(), fmt, str(redacted_out), redact_secrets=True)
            plain, redacted = by_session(fmt, plain_out), by_session(fmt, redacted_out)
            self.assertEqual(set(plain), set(redacted))
            for session_id, placed in secret_places.items():
                for place_name, name, secret in placed:
                    shown = [p for p in pieces(secret) if any(f in plain[session_id] for f in forms(p))]
                    if not shown:
                        continue  # this format does not show this place (md has no reasoning, ...)
                    checked += 1
                    places_seen.add((fmt, place_name))
                    left = [p for p in shown if any(f in redacted[session_id] for f in forms(p))]
                    if left:
                        leaks.append(f"{fmt} / {place_name} / {name}: {left[0]!r}")
        self.assertEqual(leaks, [], f"{len(leaks)} leaks out of {checked} placements:\n" + "\n".join(leaks))
        self.assertGreater(checked, 4500)
        self.assertEqual({p for f, p in places_seen if f == "jsonl"}, set(PLACES))  # jsonl shows every place
        self.assertEqual({f for f, _p in places_seen}, set(EXPORT_FORMATS))

    def test_identifiers_come_through_unchanged(self):
        odd = {"id": "sk-proj-this-is-a-session-id-not-a-key-0123456789", "source": "telegram",
               "model": "sk-ant-looks-like-a-key-model-0001", "started_at": 1700000000.25,
               "ended_at": 1700000002.9, "end_reason": "compression",
               "session_key": "agent:main:telegram:dm:42", "system_prompt": "password: hunter2",
               "messages": [
                   {"role": "assistant", "content": "token: abcdef0123456789", "timestamp": 1700000001.5,
                    "tool_calls": [{"id": "AKIAIOSFODNN7EXAMPLE", "type": "function",
                                    "function": {"name": "terminal", "arguments": '{"password": "hunter2"}'}}]},
                   {"role": "tool", "content": "ok", "tool_call_id": "AKIAIOSFODNN7EXAMPLE", "tool_name": "terminal",
                    "timestamp": 1700000002.75}]}
        child = {"id": "ghp_" + "A1" * 18, "source": "cli", "model": "gpt-4o", "parent_session_id": odd["id"],
                 "started_at": 1700000003.0, "messages": [{"role": "user", "content": "hi", "timestamp": 1700000004.0}]}
        self.assertTrue(self.db.import_sessions([odd, child])["ok"])
        plain_out, redacted_out = self.tmp / "plain.jsonl", self.tmp / "redacted.jsonl"
        write_export(self.db.export_all(), "jsonl", str(plain_out))
        write_export(self.db.export_all(), "jsonl", str(redacted_out), redact_secrets=True)
        plain = [json.loads(line) for line in plain_out.read_text().splitlines()]
        redacted = [json.loads(line) for line in redacted_out.read_text().splitlines()]
        session_keys = ("id", "source", "model", "started_at", "ended_at", "parent_session_id", "session_key",
                        "system_prompt_hash", "message_count", "tool_call_count", "last_active")
        message_keys = ("id", "session_id", "role", "timestamp", "tool_call_id", "tool_name", "active")
        for before, after in zip(plain, redacted):
            self.assertEqual({k: before[k] for k in session_keys}, {k: after[k] for k in session_keys})
            self.assertEqual(len(before["messages"]), len(after["messages"]))
            for m_before, m_after in zip(before["messages"], after["messages"]):
                self.assertEqual({k: m_before[k] for k in message_keys}, {k: m_after[k] for k in message_keys})
                for c_before, c_after in zip(m_before["tool_calls"] or [], m_after["tool_calls"] or []):
                    self.assertEqual((c_before["id"], c_before["function"]["name"]),
                                     (c_after["id"], c_after["function"]["name"]))
        self.assertNotIn("hunter2", redacted_out.read_text())
        self.assertNotIn("abcdef0123456789", redacted_out.read_text())
        lineage = self.tmp / "lineage.jsonl"
        write_export([self.db.export_session_lineage(child["id"])], "jsonl", str(lineage), redact_secrets=True)
        self.assertEqual(json.loads(lineage.read_text())["lineage_session_ids"], [odd["id"], child["id"]])
        folder = self.tmp / "md"
        write_export(self.db.export_all(), "md", str(folder), redact_secrets=True)
        self.assertIn(f"Session ID: {markdown_text(odd['id'], one_line=True)}",
                      (folder / markdown_file_name(odd["id"], "md")).read_text())


class RedactionPatterns(StoreTestCase):

    def test_every_pattern_masks_its_own_example(self):
        for name, example, needs, pattern in SECRET_PATTERNS:
            with self.subTest(name):
                self.assertTrue(any(need in example.lower() for need in needs), "the example lacks every need")
                self.assertRegex(example, pattern)
                self.assertIn("[REDACTED]", redact_text(example))

    def test_plain_text_and_identifiers_are_left_alone(self):
        plain = ["token_count: 5", "max_tokens=4096", "input_tokens: 812", "the key to success is practice",
                 "monkey: 3", "session_id=20250101_120000_abcdef", "model: claude-sonnet-4-20250514",
                 "2025-01-01T12:00:00Z", "sha256 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
                 "call_abc123XYZ", "/home/me/projects/app/src/main.py", "https://example.com/docs?page=2#top",
                 "550e8400-e29b-41d4-a716-446655440000", "git@github.com:org/repo.git", "password reset link sent",
                 "the token limit was reached", "Authorization header missing", "pinned: 1", "keyboard: us",
                 "passed 12 tests", "author: Ada", "tokenizer = load()"]
        for text in plain:
            with self.subTest(text):
                self.assertEqual(redact_text(text), text)

    def test_redaction_is_stable_when_run_twice(self):
        for name, text, _secrets in corpus():
            with self.subTest(name):
                once = redact_text(text)
                self.assertEqual(redact_text(once), once)
