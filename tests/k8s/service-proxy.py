#!/usr/bin/env python3
"""The `kubernetes` Service for the end-to-end cluster, which has no kube-proxy: accepts TCP
connections on the Service's address and port and joins each to the API server, bytes both ways
(TLS passes through; the API server's certificate names the Service's address).
    service-proxy.py LISTEN_IP:PORT TARGET_IP:PORT
"""
import asyncio
import sys


async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()


async def main(listen, target):
    host, port = target.rsplit(":", 1)

    async def join(reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError as e:
            print(f"service-proxy: cannot reach {target}: {e}", file=sys.stderr, flush=True)
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        writer.close()
        up_writer.close()

    ip, lport = listen.rsplit(":", 1)
    server = await asyncio.start_server(join, ip, int(lport))
    print(f"service-proxy: {listen} -> {target}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    asyncio.run(main(sys.argv[1], sys.argv[2]))
