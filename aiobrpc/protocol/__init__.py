"""Sans-IO protocol codecs (no asyncio here): baidu_std framing, meta, payload transforms."""
