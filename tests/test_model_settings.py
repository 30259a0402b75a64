"""A model's own settings in config.toml ([models."NAME"]) are read by the front ends, which hand
the engine resolved values (models/settings.py); the engine itself reads no settings file."""

from __future__ import annotations

import json
import subprocess
import sys

from edgechat.engine import ChatRequest, Engine, EngineConfig
from edgechat.models.settings import with_model_settings
from edgechat.tui.client import LocalClient

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")
HI = ChatRequest(messages=[{"role": "user", "content": "Hi"}])


def run_json(*args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "edgechat", "run", "--json", "--temperature", "0", "--max-tokens", "4",
                           "--ctx", "512", *args, "Hi"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_models_chat_template_in_config_toml_reaches_the_engine_through_each_front_end(isolated_dirs, smollm2_path, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text(TEMPLATE)
    isolated_dirs.config_file.parent.mkdir(parents=True, exist_ok=True)
    # typed as a path, the model's table is found under the name it is shown by (the file's stem)
    isolated_dirs.config_file.write_text(f'[models."{smollm2_path.stem}"]\nchat_template = "{template}"\n')
    given = EngineConfig(model=str(smollm2_path), n_ctx=512, paths=isolated_dirs)
    resolved = with_model_settings(given)
    assert resolved.chat_template == TEMPLATE and given.chat_template is None
    with Engine(given) as engine:  # the engine reads no settings file: the model's own template
        assert "<<user>>" not in engine.prompts.text(HI) and "Hi" in engine.prompts.text(HI)
    with Engine(resolved) as engine:
        assert engine.prompts.text(HI).endswith("<<user>> Hi\n<<assistant>>")
    # `run` lays it in as --chat-template would
    by_config, by_option = run_json("-m", str(smollm2_path)), run_json("-m", str(smollm2_path), "--chat-template", str(template))
    assert (by_config["prompt_tokens"], by_config["text"]) == (by_option["prompt_tokens"], by_option["text"])
    assert by_config["prompt_tokens"] != run_json("-m", str(smollm2_path), "--data-dir", str(tmp_path / "none"))["prompt_tokens"]
    # and so does the chat app
    client = LocalClient(str(smollm2_path), isolated_dirs, n_ctx=512)
    try:
        assert client.engine.prompts.text(HI).endswith("<<user>> Hi\n<<assistant>>")
    finally:
        client.close()
