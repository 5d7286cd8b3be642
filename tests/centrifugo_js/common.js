// What the centrifuge-js scripts of this folder share: the SDK build of a codec and its data forms, the
// server API's publish, waiting, and a relay whose connections a script can cut (a transport drop).
'use strict';
const net = require('net');

// the JSON build, or the Protobuf one (whose `data` is bytes: our messages' JSON text)
function sdk(protobuf) {
  const { Centrifuge } = protobuf ? require('centrifuge/build/protobuf') : require('centrifuge');
  return {
    Centrifuge,
    encode: (value) => (protobuf ? new TextEncoder().encode(JSON.stringify(value)) : value),
    decode: (data) => (protobuf ? JSON.parse(new TextDecoder().decode(data)) : data),
  };
}

// an offset as a number (the Protobuf build gives a Long)
const num = (value) => (value !== undefined && value !== null && typeof value === 'object' ? value.toNumber() : value);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// POST /api/publish to one channel; the publication's offset
function publisher(httpUrl, adminKey, channel) {
  return async (data) => {
    const answer = await fetch(`${httpUrl}/api/publish`, {
      method: 'POST', headers: { 'X-API-Key': adminKey, 'Content-Type': 'application/json' },
      body: JSON.stringify({ channel, data }),
    });
    if (!answer.ok) throw new Error(`publish: ${answer.status}`);
    return (await answer.json()).result.offset;
  };
}

async function until(predicate, what, ms = 5000) {
  const deadline = Date.now() + ms;
  while (!predicate()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(20);
  }
}

function relay(port) {
  const sockets = new Set();
  let accepting = true;
  const server = net.createServer((inbound) => {
    if (!accepting) { inbound.destroy(); return; }
    const outbound = net.connect(port, '127.0.0.1');
    sockets.add(inbound); sockets.add(outbound);
    inbound.pipe(outbound); outbound.pipe(inbound);
    const end = () => { inbound.destroy(); outbound.destroy(); sockets.delete(inbound); sockets.delete(outbound); };
    inbound.on('error', end); outbound.on('error', end); inbound.on('close', end); outbound.on('close', end);
  });
  return {
    listen: () => new Promise((resolve) => server.listen(0, '127.0.0.1', () => resolve(server.address().port))),
    cut: () => { accepting = false; for (const s of sockets) s.destroy(); sockets.clear(); },
    restore: () => { accepting = true; },
    close: () => server.close(),
  };
}

// what the script saw, one JSON line on stdout (exit 0), or the error on stderr (exit 1): for the Python test
function report(outcome) {
  outcome.then((result) => {
    process.stdout.write(`${JSON.stringify(result)}\n`);
    process.exit(0);
  }, (err) => {
    process.stderr.write(`${err.stack || err}\n`);
    process.exit(1);
  });
}

module.exports = { sdk, num, sleep, publisher, until, relay, report };
