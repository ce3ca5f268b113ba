// Package mpk is a small, allocation-free MessagePack toolkit for hot paths
// that write answers straight into reused buffers and pass stored
// MessagePack values through without decoding them into Go values.
//
// It offers three things:
//
//   - Skip and Valid, which find the extent of one encoded object;
//   - AppendJSON, which renders one encoded object as JSON;
//   - Append* writers, which emit the shortest MessagePack encoding of a
//     value (ints as with vmihailenco/msgpack's UseCompactInts, floats always
//     as float64, strings as str8/16/32, timestamps as extension -1).
//
// Invariants:
//
//   - No function allocates, except append growing the caller's dst.
//     Callers that reuse a buffer of sufficient capacity see zero allocations.
//   - No function panics on any input bytes. The writers panic only on
//     programmer errors: a negative length, or one that MessagePack cannot
//     represent (more than 1<<32-1 bytes or elements).
//   - Every declared length or element count is checked against the bytes
//     that remain in the input before it is used, in 64-bit arithmetic, so a
//     header claiming 1<<32-1 bytes on a short buffer is reported as
//     ErrTruncated without overflow on any platform. Because every element is
//     at least one byte long, an array or map whose count exceeds the
//     remaining bytes is rejected before any element is read, so work is
//     always linear in len(src).
//   - At most MaxDepth arrays and maps may be open at once (an empty array or
//     map counts as a level); deeper input returns ErrTooDeep. Recursion is
//     bounded by MaxDepth, so the Go stack use is bounded too.
//   - Skip and Valid check structure only: type bytes, lengths and nesting.
//     They do not validate UTF-8 in strings or the payload of extensions.
//     AppendJSON additionally rejects with ErrInvalid a timestamp
//     (extension -1) that is malformed (length not 4, 8 or 12, nanoseconds
//     above 999999999) or outside the years 0000 to 9999 that RFC 3339 can
//     write, as encoding/json does for time.Time. When AppendJSON succeeds, the number of bytes it
//     consumed equals what Skip returns for the same input.
//
// JSON rendering follows encoding/json where the two overlap: strings are
// escaped the same way (without HTML escaping; U+2028 and U+2029 are
// escaped), and floats use the same shortest formatting. NaN and ±Inf, which
// JSON cannot represent, are ErrNoJSON, as encoding/json refuses them:
// writing null would say another value (a caller shows the bytes instead).
// A str that is not UTF-8 (a key's or a value's) is ErrNoJSON too, where
// encoding/json writes \ufffd for each bad byte: that too is another value,
// and two values that differ only there would answer the same.
// AppendJSONString, for text the caller made, still writes \ufffd.
// Map keys that are strings are written as they are. Any other key is
// rendered as JSON and that text is then written as a JSON string, so the key
// 1 becomes "1" and the key [1,"a"] becomes "[1,\"a\"]". Since each such
// level of quoting can double the size of the text, non-string array or map
// keys may nest inside one another at most four deep; deeper keys return
// ErrTooDeep.
package mpk
