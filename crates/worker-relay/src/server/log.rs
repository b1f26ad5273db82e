//! The relay's output log: agent output items not yet acknowledged by a broker, encoded once.

use std::collections::VecDeque;

use bytes::{BufMut, Bytes, BytesMut};

use crate::protocol::{ExitStatus, Frame, FrameType, Seq, HEADER_LEN, VERSION};

/// Bytes before a data item's payload: the header and the sequence number.
pub(crate) const DATA_PREFIX: usize = HEADER_LEN + 8;

/// Agent output items (`data`, `eof`, `exit`) from the first unacknowledged one on, as encoded
/// frames.
#[derive(Debug)]
pub(crate) struct OutputLog {
    frames: VecDeque<(Seq, Bytes)>,
    /// The sequence number the next item gets.
    next: Seq,
    /// Every item up to this one was acknowledged by some broker.
    acked: Seq,
    /// Items up to this one were dropped unacknowledged (overflow while detached).
    discarded: Seq,
    /// Encoded bytes held.
    bytes: usize,
    /// Allocations of acknowledged items, for the stdout pump to read into again.
    recycled: Vec<BytesMut>,
}

/// Acknowledged item allocations kept for reuse, at most.
const RECYCLED: usize = 8;

/// Only allocations at least this large are worth keeping for reuse.
const RECYCLE_MIN: usize = 64 * 1024;

impl OutputLog {
    pub(crate) fn new() -> Self {
        Self {
            frames: VecDeque::new(),
            next: 1,
            acked: 0,
            discarded: 0,
            bytes: 0,
            recycled: Vec::new(),
        }
    }

    /// The last item appended (0 if none).
    pub(crate) fn last(&self) -> Seq {
        self.next - 1
    }

    pub(crate) fn acked(&self) -> Seq {
        self.acked
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The first item still held (or the next one, if none is held).
    pub(crate) fn first_held(&self) -> Seq {
        self.frames.front().map_or(self.next, |(seq, _)| *seq)
    }

    /// Appends stdout bytes as a data item.
    #[cfg(test)]
    pub(crate) fn push_data(&mut self, data: &[u8]) -> Seq {
        let mut out = BytesMut::with_capacity(DATA_PREFIX + data.len());
        out.put_bytes(0, DATA_PREFIX);
        out.put_slice(data);
        self.push_data_frame(out)
    }

    /// Appends a data item whose payload follows [`DATA_PREFIX`] reserved bytes in `frame`,
    /// filling in the header without copying the payload.
    pub(crate) fn push_data_frame(&mut self, mut frame: BytesMut) -> Seq {
        let len = frame.len() - HEADER_LEN;
        let mut header = &mut frame[..DATA_PREFIX];
        header.put_u8(VERSION);
        header.put_u8(FrameType::Data.to_u8());
        header.put_u32(len as u32);
        header.put_u64(self.next);
        self.push(frame.freeze())
    }

    pub(crate) fn push_eof(&mut self) -> Seq {
        let frame = Frame::Eof { seq: self.next };
        self.push_frame(&frame)
    }

    pub(crate) fn push_exit(&mut self, status: ExitStatus, stderr_tail: String) -> Seq {
        let frame = Frame::Exit {
            seq: self.next,
            status,
            stderr_tail,
        };
        self.push_frame(&frame)
    }

    fn push_frame(&mut self, frame: &Frame) -> Seq {
        // These frames have a non-zero sequence number and text within its bound: they encode.
        let bytes = frame.to_bytes().unwrap_or_default();
        self.push(bytes)
    }

    fn push(&mut self, bytes: Bytes) -> Seq {
        let seq = self.next;
        self.bytes += bytes.len();
        self.frames.push_back((seq, bytes));
        self.next += 1;
        seq
    }

    /// Drops every item up to `seq`, which a broker acknowledged. `seq` must not exceed
    /// [`last`](Self::last).
    pub(crate) fn ack(&mut self, seq: Seq) {
        self.acked = self.acked.max(seq);
        while let Some((first, bytes)) = self.frames.front() {
            if *first > seq {
                break;
            }
            self.bytes -= bytes.len();
            if let Some((_, bytes)) = self.frames.pop_front() {
                self.recycle(bytes);
            }
        }
    }

    /// Keeps the allocation of a dropped item if nothing else uses it and it is worth it.
    fn recycle(&mut self, bytes: Bytes) {
        if self.recycled.len() < RECYCLED && bytes.len() >= RECYCLE_MIN {
            if let Ok(mut buffer) = bytes.try_into_mut() {
                buffer.clear();
                self.recycled.push(buffer);
            }
        }
    }

    /// An allocation of an acknowledged item with room for `capacity` bytes, if one is kept.
    pub(crate) fn reuse(&mut self, capacity: usize) -> Option<BytesMut> {
        while let Some(mut buffer) = self.recycled.pop() {
            if buffer.try_reclaim(capacity) {
                return Some(buffer);
            }
        }
        None
    }

    /// Drops the oldest unacknowledged items until at most `limit` bytes are held; a broker that
    /// later asks for them gets `resume-gap`.
    pub(crate) fn discard_to(&mut self, limit: usize) {
        while self.bytes > limit {
            let Some((seq, bytes)) = self.frames.pop_front() else {
                break;
            };
            self.bytes -= bytes.len();
            self.discarded = seq;
        }
    }

    /// Whether items up to `seq` were discarded without an acknowledgement.
    pub(crate) fn discarded_beyond(&self, seq: Seq) -> bool {
        self.discarded > seq
    }

    /// Clones up to `max_bytes` (at least one item) of encoded items from `from` on, and the
    /// sequence number after the last one returned.
    pub(crate) fn collect(&self, from: Seq, max_bytes: usize, out: &mut Vec<Bytes>) -> Seq {
        let first = self.first_held();
        if from < first || from >= self.next {
            return from;
        }
        let mut taken = 0;
        let mut next = from;
        for (seq, bytes) in self.frames.range((from - first) as usize..) {
            if taken > 0 && taken + bytes.len() > max_bytes {
                break;
            }
            taken += bytes.len();
            out.push(bytes.clone());
            next = seq + 1;
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{decode_frame, Peer};

    #[test]
    fn items_are_numbered_encoded_and_dropped_on_ack() {
        let mut log = OutputLog::new();
        assert_eq!(log.push_data(b"a\n"), 1);
        assert_eq!(log.push_eof(), 2);
        assert_eq!(log.push_exit(ExitStatus::Code(3), String::new()), 3);
        let mut out = Vec::new();
        assert_eq!(log.collect(1, usize::MAX, &mut out), 4);
        let decoded: Vec<_> = out
            .iter()
            .map(|b| decode_frame(b, Peer::Relay).unwrap().unwrap().0)
            .collect();
        assert_eq!(
            decoded,
            vec![
                Frame::Data {
                    seq: 1,
                    payload: Bytes::from_static(b"a\n")
                },
                Frame::Eof { seq: 2 },
                Frame::Exit {
                    seq: 3,
                    status: ExitStatus::Code(3),
                    stderr_tail: String::new(),
                }
            ]
        );
        log.ack(2);
        assert_eq!((log.first_held(), log.acked(), log.last()), (3, 2, 3));
        out.clear();
        assert_eq!(log.collect(1, usize::MAX, &mut out), 1, "acked items are gone");
        assert!(out.is_empty());
    }

    #[test]
    fn collect_is_bounded_but_makes_progress() {
        let mut log = OutputLog::new();
        for _ in 0..4 {
            log.push_data(&[0; 100]);
        }
        let mut out = Vec::new();
        assert_eq!(log.collect(1, 10, &mut out), 2);
        assert_eq!(out.len(), 1);
        out.clear();
        assert_eq!(log.collect(2, 250, &mut out), 4);
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn acknowledged_allocations_are_reused() {
        let mut log = OutputLog::new();
        log.push_data(&[1; RECYCLE_MIN]);
        log.push_data(&[2; 10]);
        let mut out = Vec::new();
        log.collect(1, usize::MAX, &mut out);
        log.ack(2);
        assert!(log.reuse(RECYCLE_MIN).is_none(), "still held by a writer's batch");
        log.push_data(&[3; RECYCLE_MIN]);
        out.clear();
        log.ack(3);
        let buffer = log.reuse(DATA_PREFIX + RECYCLE_MIN).expect("recycled");
        assert!(buffer.is_empty() && buffer.capacity() >= DATA_PREFIX + RECYCLE_MIN);
        assert!(log.reuse(1).is_none(), "handed out once");
    }

    #[test]
    fn discarding_records_the_gap() {
        let mut log = OutputLog::new();
        for _ in 0..10 {
            log.push_data(&[0; 100]);
        }
        log.discard_to(300);
        assert!(log.bytes() <= 300);
        assert_eq!(log.first_held(), 9);
        assert!(log.discarded_beyond(0));
        assert!(!log.discarded_beyond(8));
    }
}
