// Package testserver is the backend server of the testbed and the client
// side of its protocols. One process serves, on the addresses it is given:
//
//   - HTTP: "GET /" answers the server's name (no newline) and sets the
//     X-Backend header to it; "GET /bytes?n=N" streams N bytes of Pattern.
//   - UDP echo: every datagram is answered with "<name> <datagram>".
//   - TCP stream: the client sends one line. "SEND <n>\n" makes the server
//     write n bytes of Pattern and close; "RECV\n" makes it read until the
//     client's EOF, compare what came with Pattern, and answer
//     "<bytes> <first mismatching offset or -1>\n".
//
// Pattern is a deterministic byte stream in which every 8-byte block
// depends on its offset, so lost, duplicated, reordered or corrupted bytes
// all show up as a mismatch at a precise offset.
package testserver
