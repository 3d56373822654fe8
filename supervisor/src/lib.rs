//! The relay supervisor (built in the actor-tree issue).
