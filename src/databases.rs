//! `outbox.database`: which databases the relay works in. One name, a comma-separated list, or
//! `*` for every database that allows connections (templates aside) and has the extension.

/// The databases a setting names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// `*`: every database that allows connections and is not a template.
    All,
    /// These, by name, in the order given, each once.
    Named(Vec<String>),
}

impl Selection {
    /// Reads the setting; says what is wrong with it otherwise.
    pub fn parse(setting: &str) -> Result<Selection, String> {
        let items: Vec<&str> = setting
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if items == ["*"] {
            return Ok(Selection::All);
        }
        if items.is_empty() {
            return Err("name a database, several separated by commas, or *".into());
        }
        let mut names: Vec<String> = Vec::new();
        for item in items {
            if item == "*" {
                return Err("* stands alone: it already means every database".into());
            }
            if item.len() >= 64 {
                return Err(format!("\"{item}\" is longer than a database name can be"));
            }
            if !names.iter().any(|n| n == item) {
                names.push(item.to_string());
            }
        }
        Ok(Selection::Named(names))
    }

    /// Whether the database `name` (allowing connections, `template` or not) is selected.
    pub fn selects(&self, name: &str, template: bool) -> bool {
        match self {
            Selection::All => !template,
            Selection::Named(names) => names.iter().any(|n| n == name),
        }
    }

    /// Whether a worker should wait in a database without the extension (one named) or leave,
    /// for the launcher to look again later (any database, under `*`).
    pub fn waits_for_extension(&self) -> bool {
        matches!(self, Selection::Named(_))
    }
}

/// `prefix` with `{database}` replaced by the database's name.
pub fn stream_prefix(prefix: &str, database: &str) -> String {
    prefix.replace("{database}", database)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_one_name_a_list_or_every_database() {
        assert_eq!(
            Selection::parse("postgres"),
            Ok(Selection::Named(vec!["postgres".into()]))
        );
        assert_eq!(
            Selection::parse(" shop, billing ,shop,, "),
            Ok(Selection::Named(vec!["shop".into(), "billing".into()]))
        );
        assert_eq!(Selection::parse(" * "), Ok(Selection::All));
        assert!(Selection::parse("").is_err());
        assert!(Selection::parse(" , ").is_err());
        assert!(Selection::parse("shop,*").is_err());
        assert!(Selection::parse(&"x".repeat(64)).is_err());
    }

    #[test]
    fn every_database_leaves_out_templates_and_names_take_only_themselves() {
        let all = Selection::All;
        assert!(all.selects("shop", false));
        assert!(!all.selects("template1", true));
        assert!(!all.waits_for_extension());
        let named = Selection::parse("shop,template1").unwrap();
        assert!(named.selects("shop", false));
        assert!(named.selects("template1", true));
        assert!(!named.selects("billing", false));
        assert!(named.waits_for_extension());
    }

    #[test]
    fn the_prefix_takes_the_database_name() {
        assert_eq!(stream_prefix("app:{database}:", "shop"), "app:shop:");
        assert_eq!(stream_prefix("{database}.{database}.", "a"), "a.a.");
        assert_eq!(stream_prefix("plain:", "shop"), "plain:");
    }
}
