//! When a full store is worth a WARN: a store with no room refuses every branch of a tenant,
//! so the drainer warns on the 1st, 2nd, 4th, 8th ... branch so refused (the house's rule for
//! repeated failures), and a batch that ships whole ends the episode: the next one warns from
//! its 1st branch again. Pure.

/// Branches refused for want of room in the current episode.
#[derive(Debug, Default)]
pub(super) struct NoRoomNotice {
    branches: u64,
}

impl NoRoomNotice {
    /// A branch's first refusal for want of room: its count in the episode, and whether it is
    /// one to WARN on.
    pub(super) fn refused(&mut self) -> (u64, bool) {
        self.branches += 1;
        (self.branches, broker::warn_worthy(self.branches))
    }

    /// A settle with acks and no refusal: the broker has room again.
    pub(super) fn shipped(&mut self) {
        self.branches = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_store_warns_on_powers_of_two_and_again_after_it_ships() {
        let mut notice = NoRoomNotice::default();
        let warned: Vec<u64> = (0..1_000)
            .map(|_| notice.refused())
            .filter(|(_, warn)| *warn)
            .map(|(branch, _)| branch)
            .collect();
        assert_eq!(warned, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]);
        notice.shipped();
        assert_eq!(notice.refused(), (1, true), "a new episode warns at once");
    }
}
