// centrifuge-js (the JSON build, or the Protobuf one with --protobuf) over Node's `ws`, which offers
// permessage-deflate by default, against the gateway's /connection/websocket, for
// tests/gateway/test_centrifugo_deflate.py. Usage:
//   node deflate.js HTTP_URL ADMIN_KEY CHANNEL [--json|--protobuf]
// Publishes a large book and a small tick (POST /api/publish) and prints one JSON object: the extensions
// the handshake negotiated and the publications the SDK saw.
'use strict';
const WebSocket = require('ws');
const { sdk, num, publisher, until, report } = require('./common');

const [httpUrl, adminKey, channel, mode] = process.argv.slice(2);
const protobuf = mode === '--protobuf';
const { Centrifuge, decode } = sdk(protobuf);
const publish = publisher(httpUrl, adminKey, channel);
const range = (n, f) => Array.from({ length: n }, (_, i) => f(i));
// the same book as the Python test's BOOK
const BOOK = { bids: range(40, (i) => [10000 - i, 100 + i]), asks: range(40, (i) => [10001 + i, 200 + i]) };

async function main() {
  const sockets = [];
  class Recorded extends WebSocket {  // the SDK's socket, to read what its handshake negotiated
    constructor(...args) { super(...args); sockets.push(this); }
  }
  const port = new URL(httpUrl).port;
  const c = new Centrifuge(`ws://127.0.0.1:${port}/connection/websocket`, { websocket: Recorded });
  const sub = c.newSubscription(channel);
  const publications = [];
  let subscribed = false;
  sub.on('publication', (ctx) => publications.push([num(ctx.offset), decode(ctx.data)]));
  sub.on('subscribed', () => { subscribed = true; });
  sub.subscribe();
  c.connect();
  await until(() => subscribed, 'subscribed');
  await publish(BOOK);
  await publish({ p: 1 });
  await until(() => publications.length === 2, '2 publications');
  c.disconnect();
  return { extensions: sockets[0].extensions, publications };
}

report(main());
