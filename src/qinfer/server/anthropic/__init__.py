"""Anthropic's Messages API: `messages` (routes and answers), `messages_request` (bodies)."""
