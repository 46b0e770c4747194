"""Agent episodes: the client an episode function plays with (`client.py`), the chat
template applied turn by turn (`render.py`), tool calls read from replies
(`tool_calls.py`) and the token record of an episode (`transcript.py`). The rollout that
runs episodes on the fleet is `polyrl.rollout.agent`."""
