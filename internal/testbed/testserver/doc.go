// Package testserver is the backend server of the testbed and the client
// side of its protocols. One process serves, on the addresses it is given:
//
//   - HTTP: "GET /" answers the server's name (no newline) and sets the
//     X-Backend header to it; "GET /bytes?n=N" streams N bytes of Pattern.
//   - UDP echo: every datagram is answered with "<name> <datagram>", from
//     the socket it came to. A datagram that starts "delay <ms> " is
//     answered the same way, but only after that many milliseconds (at
//     most MaxDelay), so a test can hold a UDP flow idle and then see its
//     reply (EchoDelayed).
//   - TCP stream: the client sends one line. "SEND <n>\n" makes the server
//     write n bytes of Pattern and close; "RECV\n" makes it read until the
//     client's EOF, compare what came with Pattern, and answer
//     "<bytes> <first mismatching offset or -1>\n"; "TICK <ms>\n" makes it
//     write "<seq> <name>\n" every ms milliseconds (seq from 1) until the
//     client closes or a write fails, so server-initiated data flows over a
//     connection that stays open (StartTicks).
//
// Pattern is a deterministic byte stream in which every 8-byte block
// depends on its offset, so lost, duplicated, reordered or corrupted bytes
// all show up as a mismatch at a precise offset.
//
// Main is a whole server process: it announces ReadyLine on stdout once it
// listens. Server.Close cuts open connections and drops delayed replies.
package testserver
