// fossil.js: applies Fossil deltas (the delta format of the Fossil SCM, the one Centrifugo sends) for the
// subscriptions that ask for them (docs/protocol.md). One ES module, no dependency, no build.
//
//   import { DeltaBase } from "/fossil.js";
//   const base = new DeltaBase();
//   base.whole(text);   // a whole message's JSON text: it becomes the base; returns its data
//   base.apply(delta);  // a delta entry's data (a string): returns the next message's data
//
// A delta that cannot be applied throws DeltaError and forgets the base, so nothing is built on wrong data:
// resubscribe with `since`, and the gateway sends the next message whole.
//
// The format: "<size>\n", then commands "<n>@<offset>," (copy n bytes of the base from offset) and "<n>:"
// followed by n bytes (insert them), and "<checksum>;" at the end. Numbers in base 64, digits of DIGITS,
// most significant first. The gateway's encoder is core/fossil.py.

const DIGITS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz~";
const DIGIT_VALUE = new Int8Array(256).fill(-1);
for (let i = 0; i < DIGITS.length; i++) DIGIT_VALUE[DIGITS.charCodeAt(i)] = i;
const [NEWLINE, COPY, COMMA, INSERT, END] = ["\n", "@", ",", ":", ";"].map((c) => c.charCodeAt(0));

/** A delta may rebuild at most this many bytes unless told otherwise: copies can repeat the base, so a
 * small delta could otherwise ask for gigabytes. Far above a gateway message (1 MiB at most). */
export const MAX_TARGET_BYTES = 16 * 1024 * 1024;
// 48 bits: past any size and the 32-bit checksum, and exact in a double
const MAX_NUMBER_DIGITS = 8;

/** A delta that is malformed, reads outside its base, or does not rebuild what it announced. */
export class DeltaError extends Error {
  constructor(message) {
    super(message);
    this.name = "DeltaError";
  }
}

/** Fossil's checksum: the sum, modulo 2**32, of the bytes read as big-endian 32-bit words (the last one
 * padded with zero bytes). @param {Uint8Array} bytes @returns {number} */
export function checksum(bytes) {
  let sum = 0;
  let i = 0;
  for (; i + 4 <= bytes.length; i += 4) {
    sum = (sum + ((bytes[i] << 24) >>> 0) + (bytes[i + 1] << 16) + (bytes[i + 2] << 8) + bytes[i + 3]) >>> 0;
  }
  for (let shift = 24; i < bytes.length; i++, shift -= 8) sum = (sum + ((bytes[i] << shift) >>> 0)) >>> 0;
  return sum;
}

/**
 * Reads the commands of `delta` and checks each one: numbers, copies within `base`, inserts within the delta,
 * what they write adding up to the size announced (at most `maxSize`), the checksum last. Hands each command's
 * bytes to `put` (none: only checks). Returns the size and the checksum announced.
 * @param {Uint8Array} base @param {Uint8Array} delta @param {number} maxSize
 * @param {((bytes: Uint8Array) => void) | null} put
 * @returns {{size: number, expected: number}}
 */
function readCommands(base, delta, maxSize, put) {
  let pos = 0;
  const number = () => {
    const start = pos;
    let value = 0;
    while (pos < delta.length && DIGIT_VALUE[delta[pos]] >= 0 && pos - start <= MAX_NUMBER_DIGITS) {
      value = value * 64 + DIGIT_VALUE[delta[pos++]];
    }
    if (pos === start) throw new DeltaError(`a number was expected at byte ${start} of the delta`);
    if (pos - start > MAX_NUMBER_DIGITS) {
      throw new DeltaError(`the number at byte ${start} of the delta has more than ${MAX_NUMBER_DIGITS} digits`);
    }
    return value;
  };
  const expect = (byte, after) => {
    if (delta[pos] !== byte) {
      throw new DeltaError(`${after} is not followed by ${JSON.stringify(String.fromCharCode(byte))} at byte ${pos}`);
    }
    pos++;
  };
  const size = number();
  expect(NEWLINE, "the size");
  if (size > maxSize) throw new DeltaError(`the delta announces ${size} bytes, more than the ${maxSize} allowed`);
  let written = 0;
  const write = (bytes) => {
    if (written + bytes.length > size) throw new DeltaError(`the delta writes more than the ${size} bytes it announced`);
    written += bytes.length;
    if (put) put(bytes);
  };
  while (pos < delta.length) {
    const value = number();
    if (pos >= delta.length) break;
    const command = delta[pos++];
    if (command === COPY) {
      const offset = number();
      expect(COMMA, "a copy");
      if (offset + value > base.length) {
        throw new DeltaError(`a copy of base bytes [${offset}, ${offset + value}) past its ${base.length} bytes`);
      }
      write(base.subarray(offset, offset + value));
    } else if (command === INSERT) {
      if (pos + value > delta.length) throw new DeltaError(`an insert of ${value} bytes past the end of the delta`);
      write(delta.subarray(pos, pos + value));
      pos += value;
    } else if (command === END) {
      if (pos !== delta.length) throw new DeltaError(`${delta.length - pos} bytes after the checksum`);
      if (written !== size) throw new DeltaError(`the delta rebuilt ${written} bytes, not the ${size} it announced`);
      return { size, expected: value };
    } else {
      throw new DeltaError(`unknown command ${JSON.stringify(String.fromCharCode(command))} at byte ${pos - 1}`);
    }
  }
  throw new DeltaError("the delta ends before its checksum");
}

/**
 * The bytes `delta` rebuilds from `base`, checked against the size and checksum it announces. Every command is
 * checked before the output is allocated, so a refused delta costs a pass over its own bytes, never the size
 * it announces (an 11-byte delta announcing 16 MiB allocated 16 MiB); what a well-formed one builds is exactly
 * what its commands write.
 * @param {Uint8Array} base @param {Uint8Array} delta @param {number} [maxSize]
 * @returns {Uint8Array}
 */
export function applyDelta(base, delta, maxSize = MAX_TARGET_BYTES) {
  const { size, expected } = readCommands(base, delta, maxSize, null);
  const out = new Uint8Array(size);
  let written = 0;
  readCommands(base, delta, maxSize, (bytes) => {
    out.set(bytes, written);
    written += bytes.length;
  });
  if (checksum(out) !== expected) throw new DeltaError("the rebuilt message does not match the delta's checksum");
  return out;
}

const encoder = new TextEncoder();
const decoder = new TextDecoder("utf-8", { fatal: true });

function parsed(text) {
  try {
    return JSON.parse(text);
  } catch (error) {
    throw new DeltaError(`the message is not JSON: ${error.message}`);
  }
}

/** One topic's base: the JSON text of its last message, as UTF-8 bytes. */
export class DeltaBase {
  /** @param {number} [maxBytes] the most a delta may rebuild */
  constructor(maxBytes = MAX_TARGET_BYTES) {
    this.maxBytes = maxBytes;
    /** @type {Uint8Array | null} null: the next message must come whole */
    this.bytes = null;
  }

  /** Forget the base (a resubscribe, a loss, a new epoch). */
  reset() {
    this.bytes = null;
  }

  /** A whole message as its JSON text: it becomes the base. @param {string} text @returns {unknown} */
  whole(text) {
    const data = parsed(text);
    this.bytes = encoder.encode(text);
    return data;
  }

  /** The next message's data, rebuilt from the base and a delta entry's data. @param {unknown} delta */
  apply(delta) {
    const base = this.bytes;
    this.bytes = null; // kept only if this delta applies
    if (base === null) throw new DeltaError("a delta arrived with no message to apply it to");
    if (typeof delta !== "string") throw new DeltaError(`a delta must be a JSON string, not ${typeof delta}`);
    const bytes = applyDelta(base, encoder.encode(delta), this.maxBytes);
    let text;
    try {
      text = decoder.decode(bytes);
    } catch {
      throw new DeltaError("the rebuilt message is not UTF-8");
    }
    const data = parsed(text);
    this.bytes = bytes;
    return data;
  }
}
