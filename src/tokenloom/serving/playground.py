"""The playground page served at ``/``: plain HTML and JavaScript, no external resources. It streams a
completion (server-sent events over ``fetch``) or translates, with the sampling controls of the API.

``/?autorun=1&prompt=...&max_tokens=...&temperature=0`` runs once on load (what the browser test uses; an API
key can ride in the fragment, ``#api_key=KEY``, which browsers never send); when a run ends the page sets
``<body data-state="done">`` (or ``error``) and the output is in ``#output``.
"""

PLAYGROUND_HTML = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>tokenloom playground: {{MODEL}}</title><link rel="icon" href="data:,">
<style>
body { font-family: system-ui, sans-serif; max-width: 52rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
textarea { width: 100%; min-height: 6rem; font-family: ui-monospace, monospace; }
label { margin-right: 1rem; font-size: .9rem; } input[type=number] { width: 5rem; }
#output { white-space: pre-wrap; font-family: ui-monospace, monospace; background: #f6f6f6; padding: .8rem;
  min-height: 6rem; border: 1px solid #ddd; } .error { color: #b00; } .note { color: #666; font-size: .85rem; }
button { padding: .4rem 1.2rem; margin: .6rem 0; }
</style></head>
<body data-state="idle" data-kind="{{KIND}}">
<h1>tokenloom playground</h1>
<p class="note">model <b id="model">{{MODEL}}</b> &middot; this page calls the server's own API</p>
<textarea id="prompt" placeholder="Prompt (or the sentence to translate)">ROMEO:</textarea>
<div id="controls">
<label>max tokens <input id="max_tokens" type="number" value="200" min="1"></label>
<label>temperature <input id="temperature" type="number" value="0.8" step="0.1" min="0" max="2"></label>
<label>top-k <input id="top_k" type="number" value="40" min="0"></label>
<label>top-p <input id="top_p" type="number" value="1" step="0.05" min="0.05" max="1"></label>
<label>seed <input id="seed" type="number" value="" min="0"></label>
<form id="key_form" style="display: inline" onsubmit="return false"><label>API key <input id="api_key"
 type="password" size="12" autocomplete="off"></label></form>
</div>
<button id="run">Generate</button> <span id="status" class="note"></span>
<div id="output"></div>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const kind = document.body.dataset.kind;
if (kind === "translation") { $("run").textContent = "Translate"; $("prompt").value = "Ein Hund rennt."; }

function headers() {
  const h = {"Content-Type": "application/json"};
  // a header holds bytes: send the key's UTF-8 bytes, one character each (the server compares UTF-8 bytes)
  const key = Array.from(new TextEncoder().encode($("api_key").value), (b) => String.fromCharCode(b)).join("");
  if (key) { h["Authorization"] = "Bearer " + key; }
  return h;
}
function finish(state, message) {
  document.body.dataset.state = state;
  $("status").textContent = message;
  $("run").disabled = false;
}
async function complete() {
  const body = {prompt: $("prompt").value, max_tokens: Number($("max_tokens").value) || 16,
                temperature: Number($("temperature").value), stream: true};
  if (Number($("top_k").value) > 0) { body.top_k = Number($("top_k").value); }
  if (Number($("top_p").value) < 1) { body.top_p = Number($("top_p").value); }
  if ($("seed").value !== "") { body.seed = Number($("seed").value); }
  const response = await fetch("/v1/completions", {method: "POST", headers: headers(), body: JSON.stringify(body)});
  if (!response.ok) { throw new Error((await response.json()).error.message); }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", tokens = 0;
  const started = performance.now();
  $("output").textContent = $("prompt").value;
  for (;;) {
    const {value, done} = await reader.read();
    if (done) { break; }
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\\n\\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 2);
      if (!line.startsWith("data: ")) { continue; }
      const data = line.slice(6);
      if (data === "[DONE]") { continue; }
      const event = JSON.parse(data);
      if (event.error) { throw new Error(event.error.message); }
      const choice = event.choices[0];
      if (choice && choice.text) { $("output").textContent += choice.text; tokens += 1; }
    }
  }
  const seconds = (performance.now() - started) / 1000;
  return tokens + " chunks in " + seconds.toFixed(2) + " s";
}
async function translateText() {
  const response = await fetch("/v1/translations", {method: "POST", headers: headers(),
    body: JSON.stringify({input: $("prompt").value.split("\\n").filter((s) => s.trim())})});
  const data = await response.json();
  if (!response.ok) { throw new Error(data.error.message); }
  $("output").textContent = data.data.map((d) => d.translation).join("\\n");
  return data.data.length + " sentence(s)";
}
async function run() {
  $("run").disabled = true;
  $("output").classList.remove("error");
  document.body.dataset.state = "running";
  $("status").textContent = "running...";
  try {
    finish("done", await (kind === "translation" ? translateText() : complete()));
  } catch (error) {
    $("output").classList.add("error");
    $("output").textContent = String(error.message || error);
    finish("error", "error");
  }
}
$("run").addEventListener("click", run);
const params = new URLSearchParams(location.search);
const fragment = new URLSearchParams(location.hash.slice(1));  // #api_key=...: never sent to the server's logs
if (fragment.has("api_key")) { $("api_key").value = fragment.get("api_key"); }
for (const name of ["prompt", "max_tokens", "temperature", "top_k", "top_p", "seed"]) {
  if (params.has(name)) { $(name).value = params.get(name); }
}
if (params.get("autorun") === "1") { run(); }
</script>
</body></html>
"""
