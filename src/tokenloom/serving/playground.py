"""The playground page served at ``/``: plain HTML, CSS and JavaScript, no external resources (nothing is
downloaded). Three modes for a language model, each streamed (server-sent events over ``fetch``) with the sampling
controls of the API:

- **Complete**: a prompt continued through ``POST /v1/completions``.
- **Chat**: a conversation (an optional system prompt, then user and assistant turns) sent as ``messages`` to
  ``POST /v1/chat/completions``, where the server applies the checkpoint's chat template; Enter sends, Shift+Enter
  is a new line, "Reset conversation" starts over.
- **Structured output**: a prompt continued under a ``response_format`` (a regex, a list of choices, any JSON object
  or a JSON schema); a grammar the server refuses (a 400, e.g. a character model whose vocabulary cannot spell
  JSON) shows its message in the output.

A translation checkpoint gets one "Translate" action over ``POST /v1/translations``. Model text is only ever set
with ``textContent`` / text nodes, never parsed as HTML. Ctrl+Enter runs, Escape stops a running request.

``/?autorun=1&prompt=...&max_tokens=...&temperature=0`` runs once on load (what the browser tests use; an API key
can ride in the fragment, ``#api_key=KEY``, which browsers never send). ``mode=chat`` with one or more
``message=...`` (and ``system=...``) sends those turns one after another; ``mode=structured`` with
``format=regex|choice|json_object|json_schema`` and ``regex=...``, ``choice=...`` (repeated, or one per line) or
``schema=...``. When a run ends the page sets ``<body data-state="done">`` (or ``error``); the text is in
``#output`` (``#generated`` without the prompt), the chat in ``#conversation`` and its errors in ``#chat_error``.
"""

PLAYGROUND_HTML = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>tokenloom playground: {{MODEL}}</title><link rel="icon" href="data:,">
<style>
body { font-family: system-ui, sans-serif; max-width: 52rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
h1 { margin-bottom: .2rem; }
textarea { width: 100%; box-sizing: border-box; min-height: 6rem; font-family: ui-monospace, monospace; }
textarea.short { min-height: 2.6rem; }
label { margin-right: 1rem; font-size: .9rem; } input[type=number] { width: 5rem; }
fieldset { border: 1px solid #ddd; margin: .6rem 0; padding: .4rem .8rem; }
#controls { display: flex; flex-wrap: wrap; gap: .3rem 1rem; align-items: center; }
#controls label, #modes label { white-space: nowrap; margin-right: 0; } #modes { display: flex; gap: 1.2rem; }
#controls form { display: inline; }
section > label { display: block; margin: .5rem 0 .2rem; }
legend { font-size: .85rem; color: #555; }
#modes label { font-size: 1rem; cursor: pointer; }
#output, #conversation { white-space: pre-wrap; font-family: ui-monospace, monospace; background: #f6f6f6;
  padding: .8rem; min-height: 6rem; border: 1px solid #ddd; }
#output .prompt { color: #777; }
#conversation { white-space: normal; max-height: 28rem; overflow-y: auto; }
#conversation:empty::before { content: "No messages yet."; color: #888; font-family: system-ui, sans-serif; }
.msg { margin: .3rem 0 .7rem; } .msg .role { display: block; font: .75rem system-ui, sans-serif; color: #666;
  text-transform: uppercase; letter-spacing: .04em; }
.msg .content { white-space: pre-wrap; padding: .4rem .6rem; border-radius: .4rem; display: inline-block;
  max-width: 92%; min-height: 1.2em; }
.msg.user { text-align: right; } .msg.user .content { background: #dbe9ff; text-align: left; }
.msg.assistant .content { background: #fff; border: 1px solid #e2e2e2; }
#format_controls label { display: block; margin: .3rem 0; }
#regex { width: 100%; box-sizing: border-box; font-family: ui-monospace, monospace; }
.error { color: #b00; } .note { color: #666; font-size: .85rem; }
button { padding: .4rem 1.2rem; margin: .6rem .3rem .6rem 0; }
:focus-visible { outline: 2px solid #36c; outline-offset: 1px; }
[hidden] { display: none !important; }
</style></head>
<body data-state="idle" data-kind="{{KIND}}" data-mode="complete">
<h1>tokenloom playground</h1>
<p class="note">model <b id="model">{{MODEL}}</b> &middot; this page calls the server's own API &middot;
Ctrl+Enter runs, Escape stops</p>
<fieldset id="modes"><legend>Mode</legend>
<label><input type="radio" name="mode" value="complete" checked> Complete</label>
<label><input type="radio" name="mode" value="chat"> Chat</label>
<label><input type="radio" name="mode" value="structured"> Structured output</label>
</fieldset>
<fieldset id="controls"><legend>Sampling</legend>
<label>max tokens <input id="max_tokens" type="number" value="200" min="1"></label>
<label>temperature <input id="temperature" type="number" value="0.8" step="0.1" min="0" max="2"></label>
<label>top-k <input id="top_k" type="number" value="40" min="0"></label>
<label>top-p <input id="top_p" type="number" value="1" step="0.05" min="0.05" max="1"></label>
<label>seed <input id="seed" type="number" value="" min="0"></label>
<form id="key_form" onsubmit="return false"><label>API key <input id="api_key"
 type="password" size="12" autocomplete="off"></label></form>
</fieldset>

<section id="text_panel" aria-label="prompt and output">
<textarea id="prompt" aria-label="prompt" placeholder="Prompt (or the sentence to translate)">ROMEO:</textarea>
<fieldset id="format_controls" hidden><legend>Response format (the server constrains the output to it)</legend>
<label>format <select id="format">
<option value="regex">regex</option>
<option value="choice">one of a list of choices</option>
<option value="json_object">any JSON object</option>
<option value="json_schema">JSON schema</option>
</select></label>
<label id="regex_field">regex (the whole output matches it)
<input id="regex" type="text" value="[A-Z][a-z]{1,9}( [a-z]{1,9}){2,5}[.!?]" spellcheck="false"></label>
<label id="choice_field" hidden>choices, one per line
<textarea id="choice" class="short" spellcheck="false">yes
no
perhaps</textarea></label>
<label id="schema_field" hidden>JSON schema
<textarea id="schema" spellcheck="false">{"type": "object",
 "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
 "required": ["name", "age"]}</textarea></label>
</fieldset>
<button id="run">Generate</button>
<div id="output" aria-label="output"></div>
</section>

<section id="chat_panel" aria-label="chat" hidden>
<label for="system">system prompt (optional)</label>
<textarea id="system" class="short" placeholder="e.g. You are a helpful assistant."></textarea>
<div id="conversation" role="log" aria-label="conversation"></div>
<div id="chat_error" class="error" role="alert"></div>
<label for="message">message (Enter sends, Shift+Enter for a new line)</label>
<textarea id="message" class="short" placeholder="Your message">ROMEO:</textarea>
<button id="send">Send</button><button id="reset" type="button">Reset conversation</button>
</section>

<button id="stop" disabled>Stop</button> <span id="status" class="note" role="status"></span>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const kind = document.body.dataset.kind;
let mode = "complete";
let history = [];  // the conversation: {role: "user" | "assistant", content}
let controller = null;  // the running request's AbortController
if (kind === "translation") {
  $("run").textContent = "Translate"; $("prompt").value = "Ein Hund rennt."; $("modes").hidden = true;
}

function headers() {
  const h = {"Content-Type": "application/json"};
  // a header holds bytes: send the key's UTF-8 bytes, one character each (the server compares UTF-8 bytes)
  const key = Array.from(new TextEncoder().encode($("api_key").value), (b) => String.fromCharCode(b)).join("");
  if (key) { h["Authorization"] = "Bearer " + key; }
  return h;
}
function sampling() {
  const body = {max_tokens: Number($("max_tokens").value) || 16, temperature: Number($("temperature").value),
                stream: true};
  if (Number($("top_k").value) > 0) { body.top_k = Number($("top_k").value); }
  if (Number($("top_p").value) < 1) { body.top_p = Number($("top_p").value); }
  if ($("seed").value !== "") { body.seed = Number($("seed").value); }
  return body;
}
async function errorOf(response) {  // the API's own message ({"error": {"message"}}), else the status line
  try { return (await response.json()).error.message; } catch (_) {
    return response.status + " " + response.statusText;
  }
}
async function post(path, body) {
  const response = await fetch(path, {method: "POST", headers: headers(), body: JSON.stringify(body),
                                      signal: controller.signal});
  if (!response.ok) { throw new Error(await errorOf(response)); }
  return response;
}
// POST and read the server-sent events: onText(piece) per piece; returns {chunks, finish, seconds}
async function stream(path, body, onText) {
  const started = performance.now();
  const reader = (await post(path, body)).body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", chunks = 0, finish = null;
  for (;;) {
    const {value, done} = await reader.read();
    if (done) { break; }
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 2);
      if (!line.startsWith("data: ")) { continue; }
      const data = line.slice(6);
      if (data === "[DONE]") { continue; }
      const event = JSON.parse(data);
      if (event.error) { throw new Error(event.error.message); }
      const choice = event.choices && event.choices[0];
      if (!choice) { continue; }
      const text = choice.delta ? choice.delta.content : choice.text;
      if (text) { onText(text); chunks += 1; }
      if (choice.finish_reason) { finish = choice.finish_reason; }
    }
  }
  return {chunks, finish, seconds: (performance.now() - started) / 1000};
}
function summary(result) {
  const why = {stop: "finished", length: "cut at max tokens"}[result.finish] || result.finish || "";
  return result.chunks + " chunks in " + result.seconds.toFixed(2) + " s" + (why ? " \u00b7 " + why : "");
}
function span(className, text) {
  const node = document.createElement("span");
  if (className) { node.className = className; }
  node.textContent = text;
  return node;
}

// --- complete and structured output --------------------------------------------------------------------------
function responseFormat() {
  const format = $("format").value;
  if (format === "regex") { return {type: "regex", regex: $("regex").value}; }
  if (format === "choice") {
    return {type: "choice", choice: $("choice").value.split(/\r?\n/).filter((c) => c !== "")};
  }
  if (format === "json_object") { return {type: "json_object"}; }
  let schema;
  try { schema = JSON.parse($("schema").value); } catch (error) {
    throw new Error("the JSON schema is not valid JSON: " + error.message);
  }
  return {type: "json_schema", json_schema: {name: "playground", schema}};
}
function check(format, text, finish) {  // a note on what came back (the server's grammar already holds it)
  if (finish === "length") { return "the format was not complete yet"; }
  if (finish !== "stop") { return ""; }
  if (format === "choice") { return responseFormat().choice.includes(text) ? "one of the choices" : ""; }
  if (format === "json_object" || format === "json_schema") {
    try { JSON.parse(text); return "valid JSON"; } catch (_) { return "not valid JSON"; }
  }
  return "matches the regex";
}
async function complete(structured) {
  const body = {prompt: $("prompt").value, ...sampling()};
  if (structured) { body.response_format = responseFormat(); }
  const generated = span("", "");
  generated.id = "generated";
  $("output").replaceChildren(...(structured ? [] : [span("prompt", body.prompt)]), generated);
  const result = await stream("/v1/completions", body, (text) => generated.append(text));
  if (!structured) { return summary(result); }
  const note = check($("format").value, generated.textContent, result.finish);
  return summary(result) + (note ? " \u00b7 " + note : "");
}
async function translateText() {
  const response = await post("/v1/translations",
                              {input: $("prompt").value.split("\n").filter((s) => s.trim())});
  const data = await response.json();
  $("output").textContent = data.data.map((d) => d.translation).join("\n");
  return data.data.length + " sentence(s)";
}

// --- chat ------------------------------------------------------------------------------------------------------
function bubble(role, text) {
  const message = document.createElement("div");
  message.className = "msg " + role;
  const content = span("content", text);
  message.append(span("role", role), content);
  $("conversation").append(message);
  $("conversation").scrollTop = $("conversation").scrollHeight;
  return content;
}
async function chat() {
  const text = $("message").value;
  if (!text.trim()) { $("message").focus(); return "type a message first"; }
  const messages = [];
  if ($("system").value.trim()) { messages.push({role: "system", content: $("system").value}); }
  messages.push(...history, {role: "user", content: text});
  const asked = bubble("user", text).parentNode;
  const reply = bubble("assistant", "");
  $("message").value = "";
  $("conversation").setAttribute("aria-busy", "true");
  try {
    const result = await stream("/v1/chat/completions", {messages, ...sampling()}, (piece) => {
      reply.append(piece);
      $("conversation").scrollTop = $("conversation").scrollHeight;
    });
    history.push({role: "user", content: text}, {role: "assistant", content: reply.textContent});
    return summary(result);
  } catch (error) {
    if (reply.textContent) {  // a partial reply (stopped, or an error mid-stream) stays in the conversation
      history.push({role: "user", content: text}, {role: "assistant", content: reply.textContent});
    } else {  // nothing came back: take the turn back, the message returns to its box to try again
      asked.remove(); reply.parentNode.remove();
      if (!$("message").value) { $("message").value = text; }
    }
    throw error;
  } finally {
    $("conversation").removeAttribute("aria-busy");
  }
}
function resetChat() {
  if (controller) { controller.abort(); }
  history = [];
  $("conversation").replaceChildren();
  $("chat_error").textContent = "";
  $("status").textContent = "";
  $("message").focus();
}

// --- running ---------------------------------------------------------------------------------------------------
function busy(running) {
  for (const id of ["run", "send"]) { $(id).disabled = running; }
  $("stop").disabled = !running;
}
function showError(message) {
  if (mode === "chat" && kind !== "translation") { $("chat_error").textContent = message; return; }
  $("output").classList.add("error");
  $("output").textContent = message;
}
async function run() {
  if (controller) { return; }
  controller = new AbortController();
  busy(true);
  $("output").classList.remove("error");
  $("chat_error").textContent = "";
  document.body.dataset.state = "running";
  $("status").textContent = "running...";
  let state = "done", message;
  try {
    message = await (kind === "translation" ? translateText()
                     : mode === "chat" ? chat() : complete(mode === "structured"));
  } catch (error) {
    if (error.name === "AbortError") { message = "stopped"; } else {
      state = "error"; message = "error";
      showError(String(error.message || error));
    }
  }
  controller = null;
  busy(false);
  document.body.dataset.state = state;
  $("status").textContent = message;
  if (mode === "chat") { $("message").focus(); }
}
function stop() { if (controller) { controller.abort(); } }
function setMode(name) {
  if (!["complete", "chat", "structured"].includes(name)) { name = "complete"; }
  mode = name;
  document.body.dataset.mode = name;
  for (const radio of document.querySelectorAll("input[name=mode]")) { radio.checked = radio.value === name; }
  $("chat_panel").hidden = name !== "chat";
  $("text_panel").hidden = name === "chat";
  $("format_controls").hidden = name !== "structured";
  $("output").replaceChildren();
  $("output").classList.remove("error");
  $("status").textContent = "";
}
function showFormat() {
  const format = $("format").value;
  $("regex_field").hidden = format !== "regex";
  $("choice_field").hidden = format !== "choice";
  $("schema_field").hidden = format !== "json_schema";
}

$("run").addEventListener("click", run);
$("send").addEventListener("click", run);
$("stop").addEventListener("click", stop);
$("reset").addEventListener("click", resetChat);
$("format").addEventListener("change", showFormat);
for (const radio of document.querySelectorAll("input[name=mode]")) {
  radio.addEventListener("change", () => { if (radio.checked) { stop(); setMode(radio.value); } });
}
$("message").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) { event.preventDefault(); run(); }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape") { stop(); }
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); run(); }
});

const params = new URLSearchParams(location.search);
const fragment = new URLSearchParams(location.hash.slice(1));  // #api_key=...: never sent to the server's logs
if (fragment.has("api_key")) { $("api_key").value = fragment.get("api_key"); }
for (const name of ["prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "system", "format", "regex",
                    "schema"]) {
  if (params.has(name)) { $(name).value = params.get(name); }
}
if (params.has("choice")) { $("choice").value = params.getAll("choice").join("\n"); }
if (params.has("mode") && kind !== "translation") { setMode(params.get("mode")); }
showFormat();
(async () => {
  if (params.get("autorun") !== "1") { return; }
  const messages = params.getAll("message");
  if (mode !== "chat" || !messages.length) { await run(); return; }
  for (const message of messages) {  // the turns one after another, each after the reply to the one before
    $("message").value = message;
    await run();
    if (document.body.dataset.state !== "done") { break; }
  }
})();
</script>
</body></html>
"""
